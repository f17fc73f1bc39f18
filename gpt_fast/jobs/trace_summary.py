"""Summary of a Chrome trace written by ``torch.profiler``: launches, GPU kernels, GPU idle time.

The summary covers one scope of the trace, the first that applies:

* "decode": while profiling, the generator wraps the prefill in
  ``torch.profiler.record_function(PREFILL_MARK)`` and every decode step in
  ``torch.profiler.record_function(DECODE_MARK)``; ``prof.export_chrome_trace`` turns those into
  ``ph: "X"`` events of category ``user_annotation``. Figures are per decoded token.
* "speculative decode": a speculative run marks each round's draft phase (``DRAFT_MARK``) and verify step
  (``VERIFY_MARK``) instead of decode steps; the scope is both, figures are per verify step, and the verify steps'
  own launches are counted apart (one graph launch each in ``reduce-overhead``).
* "ProfilerStep": any other torch.profiler run whose loop calls ``prof.step()`` has a
  ``ProfilerStep#N`` annotation around each recorded step. Figures are per step.
* "whole trace": every event of the trace. Figures are totals.

Reported: runtime kernel/graph launches (CUDA and HIP names), GPU kernels, how busy the GPU
was, its largest idle gaps, the kernels that took the time, and the collectives' kernels among them (NCCL's and
RCCL's, whose kernels keep NCCL's names, and PyTorch's symmetric-memory all-reduce: tensor parallelism).

Attribution follows kineto's trace format: a runtime or driver call (``cuda_runtime`` /
``cuda_driver``; ROCm's HIP calls are also written as ``cuda_runtime``) belongs to the scope
when its start lies inside a mark of the same process; a GPU kernel, memcpy or memset belongs
to it when its ``args.correlation`` is that of a call in the scope. Every kernel of a CUDA/HIP
graph replay carries the correlation id of the graph launch. GPU events without a correlation
id fall back to time (see TIME_FALLBACK_SLACK_US).

Traces can be hundreds of MB, so the file (plain or gzip) is streamed with ijson in one
pass and only compact columns (``array``/numpy) of the relevant events are kept. The input
itself is bounded (see _GuardedReader): its size, its nesting depth and the bytes of one event.
"""

from __future__ import annotations

import gzip
import math
import re
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

import ijson
import numpy as np

from gpt_fast.generation.profiling import DECODE_MARK, DRAFT_MARK, PREFILL_MARK, VERIFY_MARK
from gpt_fast.util.fileio import first_line

# Launch APIs under the names kineto writes (CUPTI runtime and driver callbacks, HIP
# runtime via roctracer / rocprofiler-sdk); matched exactly once _API_SUFFIX is stripped.
KERNEL_LAUNCH_APIS = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaLaunchCooperativeKernel",
        "cudaLaunchCooperativeKernelMultiDevice",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuLaunchCooperativeKernel",
        "hipLaunchKernel",
        "hipLaunchKernelExC",
        "hipModuleLaunchKernel",
        "hipExtModuleLaunchKernel",
        "hipHccModuleLaunchKernel",
        "hipExtLaunchKernel",
        "hipLaunchCooperativeKernel",
        "hipModuleLaunchCooperativeKernel",
        "hipDrvLaunchKernelEx",
    }
)
GRAPH_LAUNCH_APIS = frozenset({"cudaGraphLaunch", "cuGraphLaunch", "hipGraphLaunch"})
# Per-thread default stream variants (CUDA "_ptsz", HIP "_spt") and CUPTI's version
# suffixes ("_v7000", as in nsys exports), in any combination.
_API_SUFFIX = re.compile(r"(?:_(?:ptsz|spt|v\d+))+$")

RUNTIME_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
CPU_OP_CATEGORY = "cpu_op"  # an operator run on the CPU (aten::mm), nested in the operators that called it
GPU_MARK_CATEGORY = "gpu_user_annotation"
KERNEL, MEMCPY, MEMSET = 0, 1, 2
# Old kineto versions wrote "Kernel".
GPU_CATEGORIES = {"kernel": KERNEL, "Kernel": KERNEL, "gpu_memcpy": MEMCPY, "gpu_memset": MEMSET}

# What a summary covers (TraceSummary.scope) and what its per-unit figures divide by.
SCOPE_DECODE, SCOPE_STEPS, SCOPE_WHOLE = "decode", "ProfilerStep", "whole trace"
SCOPE_SPECULATIVE = "speculative decode"
UNITS = {SCOPE_DECODE: "token", SCOPE_SPECULATIVE: "verify_step", SCOPE_STEPS: "step", SCOPE_WHOLE: "trace"}
_SCOPE_PHRASES = {
    SCOPE_DECODE: "decode",
    SCOPE_SPECULATIVE: "speculative decode",
    SCOPE_STEPS: "the profiler steps",
    SCOPE_WHOLE: "the trace",
}
# torch.profiler's annotation around each step recorded between two ``prof.step()`` calls.
STEP_MARK_PREFIX = "ProfilerStep#"

# GPU events without a correlation id count as in scope when they start between the first
# mark's start and the last one's end plus this much (the GPU lags the CPU).
TIME_FALLBACK_SLACK_US = 10_000.0
LARGEST_GAPS = 5

# Input bounds (see _GuardedReader); module constants so that tests can lower them.
MAX_JSON_BYTES = 4 << 30  # of JSON text in all, once gunzipped
MAX_EVENT_BYTES = 1 << 20  # read without completing one trace event (kineto's are well under 10 kB)
MAX_DEPTH = 64  # nesting of arrays and objects (kineto's traces nest a handful of levels)
READ_BYTES = 1 << 16  # bytes handed to the parser at a time; it holds the events parsed from one read

# Kernels of collectives: NCCL's ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ncclKernel_..."), RCCL's (the same
# names, and "ncclDevKernel_Generic"), PyTorch's symmetric-memory ones ("...one_shot_all_reduce_kernel<...>").
COLLECTIVE_KERNEL = re.compile(r"(?:^|[\s:])[nr]ccl\w*kernel|(?:one_shot|two_shot|multimem)_\w*_kernel", re.IGNORECASE)

_NO_CORRELATION = -1
_MAX_CORRELATION = 2**63 - 1
_OTHER_CALL, _KERNEL_LAUNCH, _GRAPH_LAUNCH = 0, 1, 2
_CALL_CODES = {"kernel": _KERNEL_LAUNCH, "graph": _GRAPH_LAUNCH}
_GZIP_MAGIC = b"\x1f\x8b"
_NUMBER_TYPES = (int, float)  # as ijson builds them with use_float=True
_MARK_PREFIXES = (DECODE_MARK, PREFILL_MARK, VERIFY_MARK, DRAFT_MARK, STEP_MARK_PREFIX)  # a cheap first test
_QUOTE, _BACKSLASH, _OPEN, _CLOSE = ord('"'), ord("\\"), ord("{"), ord("}")
_CASE_BIT = 0x20  # "[" | 0x20 == "{" and "]" | 0x20 == "}"


@lru_cache(maxsize=4096)
def launch_kind(name: str) -> str | None:
    """Return "kernel" or "graph" for a launch API name (suffixes ignored), else None."""
    base = _API_SUFFIX.sub("", name)
    if base in KERNEL_LAUNCH_APIS:
        return "kernel"
    if base in GRAPH_LAUNCH_APIS:
        return "graph"
    return None


def is_step_mark(name: str) -> bool:
    """True for torch.profiler's ``ProfilerStep#N`` annotations."""
    return name.startswith(STEP_MARK_PREFIX) and name[len(STEP_MARK_PREFIX) :].isdigit()


@dataclass(frozen=True)
class TraceSummary:
    """Figures of one trace over its scope (SCOPE_*); times are in microseconds."""

    path: str
    scope: str  # SCOPE_DECODE, SCOPE_SPECULATIVE, SCOPE_STEPS or SCOPE_WHOLE
    units: int  # what per-unit figures divide by: decoded tokens, verify steps, profiler steps, or 1 (whole trace)
    kernel_launches: int
    graph_launches: int
    gpu_kernels: int
    gpu_memcpys: int
    gpu_memsets: int
    kernel_time_us: float
    busy_fraction: float | None
    gpu_window_us: float | None  # first kernel start to last kernel end, in scope
    wall_us: float  # CPU: first mark start to last mark end; whole trace: first event start to last event end
    largest_gaps: tuple[tuple[float, float], ...]  # (offset in window, gap), largest first
    top_kernels: tuple[tuple[str, int, float], ...]  # (name, count, total), largest first
    prefill_us: float | None  # wall time of all prefill marks together; None if unmarked
    prefills: int
    verify_steps: int = 0  # VERIFY_MARK marks (speculative decoding)
    verify_us: float = 0.0  # their wall time together
    verify_kernel_launches: int = 0  # runtime launches inside them
    verify_graph_launches: int = 0
    draft_us: float = 0.0  # wall time of the DRAFT_MARK marks together
    collective_kernels: int = 0  # kernels of collectives (COLLECTIVE_KERNEL), in scope
    collective_time_us: float = 0.0  # their GPU time together
    # CPU operators by self time (their time less the operators they called), largest first: (name, count, total)
    top_cpu_ops: tuple[tuple[str, int, float], ...] = ()
    cpu_op_time_us: float = 0.0  # the self time of every CPU operator in scope together

    @property
    def unit(self) -> str:
        """What ``units`` counts: "token", "verify_step", "step" or "trace"."""
        return UNITS[self.scope]

    @property
    def unit_name(self) -> str:
        return self.unit.replace("_", " ")

    def per_unit(self, count: float) -> float:
        return count / self.units

    def kernel_share(self, total_us: float) -> float:
        """Fraction of the in-scope kernel time that ``total_us`` represents."""
        return total_us / self.kernel_time_us if self.kernel_time_us > 0 else 0.0

    # The names of the decode-only summaries that came first, for their callers; None outside the decode scope.
    def _in_decode(self, value: float | None) -> float | None:
        return value if self.scope == SCOPE_DECODE else None

    @property
    def tokens(self) -> int | None:
        return self.units if self.scope == SCOPE_DECODE else None

    @property
    def decode_window_us(self) -> float | None:
        return self._in_decode(self.gpu_window_us)

    @property
    def decode_wall_us(self) -> float | None:
        return self._in_decode(self.wall_us)

    @property
    def kernel_launches_per_token(self) -> float | None:
        return self._in_decode(self.per_unit(self.kernel_launches))

    @property
    def graph_launches_per_token(self) -> float | None:
        return self._in_decode(self.per_unit(self.graph_launches))

    @property
    def gpu_kernels_per_token(self) -> float | None:
        return self._in_decode(self.per_unit(self.gpu_kernels))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for ``--json``): the fields, ``unit``, and the count and per-unit figures named after
        the unit: ``tokens`` and ``kernel_launches_per_token`` in decode, ``steps`` and ``..._per_step`` per
        ProfilerStep, none for the whole trace."""
        out = asdict(self)
        out["unit"] = self.unit
        if self.scope != SCOPE_WHOLE:
            out[f"{self.unit}s"] = self.units
            for name in ("kernel_launches", "graph_launches", "gpu_kernels"):
                out[f"{name}_per_{self.unit}"] = self.per_unit(out[name])
        out["largest_gaps"] = [{"offset_us": o, "gap_us": g} for o, g in self.largest_gaps]
        out["top_kernels"] = [
            {"name": n, "count": c, "total_us": t, "share": self.kernel_share(t)} for n, c, t in self.top_kernels
        ]
        return out


class _Marks:
    """Start and end, per process, of the annotations that delimit a scope."""

    def __init__(self) -> None:
        self.pid, self.start, self.end = array("q"), array("d"), array("d")

    def add(self, pid: int, ts: float, dur: float) -> None:
        self.pid.append(pid)
        self.start.append(ts)
        self.end.append(ts + dur)

    def __len__(self) -> int:
        return len(self.start)


class _Columns:
    """Compact columns of the events the summary needs; all else is dropped as read."""

    def __init__(self) -> None:
        self.events = 0
        self.first_start, self.last_end = math.inf, -math.inf  # of all complete events
        self.pids: dict[Any, int] = {}
        self.names: dict[str, int] = {}
        self.decode, self.steps, self.verify, self.draft = _Marks(), _Marks(), _Marks(), _Marks()
        self.prefills, self.prefill_us = 0, 0.0
        self.call_pid, self.call_ts = array("q"), array("d")
        self.call_corr, self.call_kind = array("q"), array("b")
        self.gpu_kind, self.gpu_corr, self.gpu_name = array("b"), array("q"), array("q")
        self.gpu_start, self.gpu_dur = array("d"), array("d")
        self.threads: dict[Any, int] = {}
        self.op_pid, self.op_thread, self.op_name = array("q"), array("q"), array("q")
        self.op_start, self.op_dur = array("d"), array("d")

    def add(self, event: Any) -> None:
        self.events += 1
        if not isinstance(event, dict) or event.get("ph") != "X":
            return
        name, ts = event.get("name"), event.get("ts")
        if not isinstance(name, str) or not _is_time(ts):
            return
        dur = _duration(event)
        if ts < self.first_start:
            self.first_start = ts
        if ts + dur > self.last_end:
            self.last_end = ts + dur
        cat = event.get("cat")
        cat = cat if isinstance(cat, str) else ""
        if cat in GPU_CATEGORIES:
            self._add_gpu(event, GPU_CATEGORIES[cat], name, ts, dur)
        elif cat == CPU_OP_CATEGORY:
            self._add_op(event, name, ts, dur)
        elif name.startswith(_MARK_PREFIXES):
            if cat != GPU_MARK_CATEGORY:
                self._add_mark(event, name, ts, dur)
        else:
            kind = launch_kind(name)
            if kind is not None or cat in RUNTIME_CATEGORIES:
                self._add_call(event, kind, ts)

    def _pid(self, event: dict[str, Any]) -> int:
        pid = event.get("pid")
        key = pid if isinstance(pid, (int, str)) else repr(pid)
        return self.pids.setdefault(key, len(self.pids))

    def _add_mark(self, event: dict[str, Any], name: str, ts: float, dur: float) -> None:
        if name == PREFILL_MARK:
            self.prefills += 1
            self.prefill_us += dur
        elif name == DECODE_MARK:
            self.decode.add(self._pid(event), ts, dur)
        elif name == VERIFY_MARK:
            self.verify.add(self._pid(event), ts, dur)
        elif name == DRAFT_MARK:
            self.draft.add(self._pid(event), ts, dur)
        elif is_step_mark(name):
            self.steps.add(self._pid(event), ts, dur)

    def _add_call(self, event: dict[str, Any], kind: str | None, ts: float) -> None:
        self.call_pid.append(self._pid(event))
        self.call_ts.append(ts)
        self.call_corr.append(_correlation(event))
        self.call_kind.append(_CALL_CODES.get(kind, _OTHER_CALL))

    def _add_op(self, event: dict[str, Any], name: str, ts: float, dur: float) -> None:
        tid = event.get("tid")
        self.op_pid.append(self._pid(event))
        self.op_thread.append(
            self.threads.setdefault(tid if isinstance(tid, (int, str)) else repr(tid), len(self.threads))
        )
        self.op_name.append(self.names.setdefault(name, len(self.names)))
        self.op_start.append(ts)
        self.op_dur.append(dur)

    def _add_gpu(self, event: dict[str, Any], kind: int, name: str, ts: float, dur: float) -> None:
        self.gpu_kind.append(kind)
        self.gpu_corr.append(_correlation(event))
        self.gpu_name.append(self.names.setdefault(name, len(self.names)))
        self.gpu_start.append(ts)
        self.gpu_dur.append(dur)


def _is_time(value: Any) -> bool:
    """A finite int or float (not a bool, NaN or infinity)."""
    return type(value) in _NUMBER_TYPES and -math.inf < value < math.inf


def _duration(event: dict[str, Any]) -> float:
    dur = event.get("dur")
    return float(dur) if _is_time(dur) and dur > 0 else 0.0


def _correlation(event: dict[str, Any]) -> int:
    args = event.get("args")
    corr = args.get("correlation") if isinstance(args, dict) else None
    if type(corr) is float and corr.is_integer():
        corr = int(corr)
    return corr if type(corr) is int and 0 <= corr <= _MAX_CORRELATION else _NO_CORRELATION


class _GuardedReader:
    """A binary file for ijson that refuses, as one-line ValueErrors, input that would make the parse unbounded.

    * Size: MAX_JSON_BYTES in all (a gzip bomb inflates without end), and MAX_EVENT_BYTES read without a
      complete trace event: ijson builds each event whole in memory, and yajl re-reads a token that spans
      two reads, which takes time quadratic in the token's length (a 100 MB number: minutes).
    * Depth: yajl accepts any nesting, and ijson builds a path string per level, so that its time and
      memory grow with the square of the depth (40 000 levels: 10 s and 4 GB). Brackets outside strings
      are counted here, with numpy, before the parser sees them; strings are told by their unescaped
      quotes. Past a syntax error the count may go wrong (it runs a read ahead of yajl), so that invalid
      JSON may be called too deep rather than malformed: a one-line ValueError either way.
    """

    def __init__(self, stream: BinaryIO, path: Path) -> None:
        self._stream, self._path = stream, path
        self.size = 0  # bytes read so far
        self.size_at_event = 0  # ``size`` when the consumer last took an event (see took_event)
        self._depth = 0
        self._in_string = False
        self._backslashes = 0  # length of the run of backslashes that ended the last read

    def took_event(self) -> None:
        self.size_at_event = self.size

    def read(self, size: int = READ_BYTES) -> bytes:
        if self.size - self.size_at_event > MAX_EVENT_BYTES:
            raise ValueError(f"{self._path}: more than {MAX_EVENT_BYTES} bytes of JSON without a complete trace event")
        chunk = self._stream.read(size)
        self.size += len(chunk)
        if self.size > MAX_JSON_BYTES:
            raise ValueError(f"{self._path}: more than {MAX_JSON_BYTES} bytes of JSON (a gzip bomb?)")
        if chunk:
            self._count_depth(chunk)
        return chunk

    def _count_depth(self, chunk: bytes) -> None:
        data = np.frombuffer(chunk, np.uint8)
        quotes = self._unescaped_quotes(chunk, data)  # positions
        folded = data | _CASE_BIT
        brackets = np.flatnonzero((folded == _OPEN) | (folded == _CLOSE))
        outside = (np.searchsorted(quotes, brackets) + self._in_string) & 1 == 0
        steps = np.where(folded[brackets[outside]] == _OPEN, 1, -1)
        if len(steps):
            depth = np.cumsum(steps) + self._depth
            if int(depth.max()) > MAX_DEPTH:
                raise ValueError(f"{self._path}: JSON nested deeper than {MAX_DEPTH} levels")
            self._depth = int(depth[-1])
        self._in_string ^= len(quotes) % 2 == 1

    def _unescaped_quotes(self, chunk: bytes, data: np.ndarray) -> np.ndarray:
        """Positions of the quotes of ``chunk`` that open or close a string (not preceded by an odd run of
        backslashes, counting those at the end of the previous read)."""
        quotes = np.flatnonzero(data == _QUOTE)
        if not self._backslashes and b"\\" not in chunk:
            return quotes
        others = np.flatnonzero(data != _BACKSLASH)  # holds every quote
        if len(others) == 0:
            self._backslashes += len(chunk)
            return quotes
        index = np.searchsorted(others, quotes)
        previous = np.where(index > 0, others[index - 1], -1 - self._backslashes)
        self._backslashes = len(chunk) - 1 - int(others[-1])
        return quotes[(quotes - previous) % 2 == 1]


def _events(path: Path) -> Iterator[Any]:
    """Stream the items of the top-level ``traceEvents`` array of a (gzipped) JSON file."""
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with path.open("rb") as raw:
        gzipped = raw.read(2) == _GZIP_MAGIC
        raw.seek(0)
        reader = _GuardedReader(gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw, path)
        try:
            for event in ijson.items(reader, "traceEvents.item", use_float=True, buf_size=READ_BYTES):
                reader.took_event()
                yield event
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:
            raise ValueError(f"{path}: corrupt gzip data ({first_line(err)})") from err
        except (ijson.JSONError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: malformed JSON ({first_line(err)})") from err


def _read(path: Path) -> _Columns:
    columns = _Columns()
    for event in _events(path):
        columns.add(event)
    if columns.events == 0:
        raise ValueError(f"{path}: not a Chrome trace (no events in a traceEvents array)")
    if columns.first_start > columns.last_end:
        raise ValueError(f'{path}: the trace has no complete events (ph "X" with a name and a numeric ts)')
    return columns


def _scope(c: _Columns, path: Path) -> tuple[str, _Marks | None]:
    """The scope that applies to the trace, and its marks (None for the whole trace)."""
    if len(c.decode):
        return SCOPE_DECODE, c.decode
    if len(c.verify):
        return SCOPE_SPECULATIVE, _joined(c.verify, c.draft)
    if c.prefills:
        raise ValueError(
            f"{path}: the trace has {PREFILL_MARK!r} but no {DECODE_MARK!r} or {VERIFY_MARK!r} marks: nothing was "
            "decoded in this `gpt-fast generate --profile` run"
        )
    if len(c.steps):
        return SCOPE_STEPS, c.steps
    return SCOPE_WHOLE, None


def _joined(first: _Marks, second: _Marks) -> _Marks:
    joined = _Marks()
    for marks in (first, second):
        joined.pid.extend(marks.pid)
        joined.start.extend(marks.start)
        joined.end.extend(marks.end)
    return joined


def _span(marks: _Marks) -> float:
    """The marks' wall time together."""
    return float(np.sum(np.asarray(marks.end) - np.asarray(marks.start))) if len(marks) else 0.0


def _inside_marks(pid: np.ndarray, ts: np.ndarray, marks: _Marks) -> np.ndarray:
    """Mask of the (pid, ts) points that lie inside a mark of the same pid."""
    mark_pid, start, end = (np.asarray(a) for a in (marks.pid, marks.start, marks.end))
    inside = np.zeros(len(ts), dtype=bool)
    for p in np.unique(mark_pid):
        mine = mark_pid == p
        order = np.argsort(start[mine], kind="stable")
        starts = start[mine][order]
        # Furthest end among the marks started so far: robust to overlapping marks.
        reach = np.maximum.accumulate(end[mine][order])
        sel = np.flatnonzero(pid == p)
        idx = np.searchsorted(starts, ts[sel], side="right") - 1
        ok = idx >= 0
        inside[sel[ok]] = ts[sel[ok]] <= reach[idx[ok]]
    return inside


def _gpu_mask(c: _Columns, marks: _Marks, scope_corr: np.ndarray) -> np.ndarray:
    corr, start = np.asarray(c.gpu_corr), np.asarray(c.gpu_start)
    by_corr = np.isin(corr, scope_corr)
    lo = min(marks.start)
    hi = max(marks.end) + TIME_FALLBACK_SLACK_US
    by_time = (corr == _NO_CORRELATION) & (start >= lo) & (start <= hi)
    return by_corr | by_time


def _in_scope(c: _Columns, marks: _Marks | None) -> tuple[np.ndarray, np.ndarray]:
    """Masks of the runtime calls and of the GPU events that belong to the scope."""
    if marks is None:
        return np.ones(len(c.call_ts), dtype=bool), np.ones(len(c.gpu_start), dtype=bool)
    call_in = _inside_marks(np.asarray(c.call_pid), np.asarray(c.call_ts), marks)
    call_corr = np.asarray(c.call_corr)[call_in]
    return call_in, _gpu_mask(c, marks, np.unique(call_corr[call_corr != _NO_CORRELATION]))


def _idle_profile(
    start: np.ndarray, end: np.ndarray
) -> tuple[float | None, float | None, tuple[tuple[float, float], ...]]:
    """Busy fraction, window length and largest gaps of the union of [start, end)."""
    if len(start) == 0:
        return None, None, ()
    order = np.argsort(start, kind="stable")
    s = start[order]
    reach = np.maximum.accumulate(end[order])
    window = float(reach[-1] - s[0])
    gap = s[1:] - reach[:-1]
    idle = np.flatnonzero(gap > 0)
    busy = (window - float(gap[idle].sum())) / window if window > 0 else None
    largest = idle[np.argsort(-gap[idle], kind="stable")[:LARGEST_GAPS]]
    gaps = tuple((float(reach[i] - s[0]), float(gap[i])) for i in largest)
    return busy, window, gaps


def _top_kernels(
    name_idx: np.ndarray, dur: np.ndarray, names: list[str], top: int
) -> tuple[tuple[str, int, float], ...]:
    totals = np.bincount(name_idx, weights=dur, minlength=len(names))
    counts = np.bincount(name_idx, minlength=len(names))
    order = [i for i in np.argsort(-totals, kind="stable") if counts[i] > 0][:top]
    return tuple((names[i], int(counts[i]), float(totals[i])) for i in order)


def _self_times(thread: np.ndarray, start: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Each operator's self time: its duration less those of the operators directly inside it on its thread."""
    own = dur.copy()
    order = np.lexsort((-dur, start, thread))  # by thread, then start; an enclosing operator before its first child
    open_ops: list[int] = []  # the operators enclosing the current one, innermost last
    previous_thread = None
    for i in order:
        if thread[i] != previous_thread:
            open_ops, previous_thread = [], thread[i]
        while open_ops and start[open_ops[-1]] + dur[open_ops[-1]] <= start[i]:
            open_ops.pop()
        if open_ops:
            own[open_ops[-1]] -= dur[i]
        open_ops.append(i)
    return np.maximum(own, 0.0)


def _top_cpu_ops(c: _Columns, marks: _Marks | None, top: int) -> tuple[tuple[tuple[str, int, float], ...], float]:
    """The CPU operators in scope that took the most self time, and the self time of all of them."""
    start, dur = np.asarray(c.op_start), np.asarray(c.op_dur)
    own = _self_times(np.asarray(c.op_thread) * len(c.pids) + np.asarray(c.op_pid), start, dur)
    inside = np.ones(len(start), dtype=bool) if marks is None else _inside_marks(np.asarray(c.op_pid), start, marks)
    names = np.asarray(c.op_name, dtype=np.int64)[inside]
    return _top_kernels(names, own[inside], list(c.names), top), float(own[inside].sum())


def _collectives(name_idx: np.ndarray, dur: np.ndarray, names: list[str]) -> tuple[int, float]:
    """How many of the kernels (``name_idx`` into ``names``) are collectives', and their time together."""
    is_collective = np.array([bool(COLLECTIVE_KERNEL.search(name)) for name in names], dtype=bool)
    chosen = is_collective[name_idx] if len(names) else np.zeros(len(name_idx), dtype=bool)
    return int(np.count_nonzero(chosen)), float(dur[chosen].sum())


def _summarize(c: _Columns, path: Path, top: int) -> TraceSummary:
    scope, marks = _scope(c, path)
    call_in, gpu_in = _in_scope(c, marks)
    call_kind = np.asarray(c.call_kind)[call_in]
    gpu_kind = np.asarray(c.gpu_kind)
    kernels = gpu_in & (gpu_kind == KERNEL)
    start, dur = np.asarray(c.gpu_start)[kernels], np.asarray(c.gpu_dur)[kernels]
    busy, window, gaps = _idle_profile(start, start + dur)
    collective_kernels, collective_time = _collectives(
        np.asarray(c.gpu_name, dtype=np.int64)[kernels], dur, list(c.names)
    )
    top_cpu_ops, cpu_op_time = _top_cpu_ops(c, marks, top) if len(c.op_start) else ((), 0.0)
    verify_kind = np.zeros(0, dtype=np.int8)
    if len(c.verify):
        verify_kind = np.asarray(c.call_kind)[_inside_marks(np.asarray(c.call_pid), np.asarray(c.call_ts), c.verify)]
    return TraceSummary(
        path=str(path),
        scope=scope,
        units=1 if marks is None else len(c.verify) if scope == SCOPE_SPECULATIVE else len(marks),
        kernel_launches=int(np.count_nonzero(call_kind == _KERNEL_LAUNCH)),
        graph_launches=int(np.count_nonzero(call_kind == _GRAPH_LAUNCH)),
        gpu_kernels=int(np.count_nonzero(kernels)),
        gpu_memcpys=int(np.count_nonzero(gpu_in & (gpu_kind == MEMCPY))),
        gpu_memsets=int(np.count_nonzero(gpu_in & (gpu_kind == MEMSET))),
        kernel_time_us=float(dur.sum()),
        busy_fraction=busy,
        gpu_window_us=window,
        wall_us=c.last_end - c.first_start if marks is None else max(marks.end) - min(marks.start),
        largest_gaps=gaps,
        top_kernels=_top_kernels(np.asarray(c.gpu_name)[kernels], dur, list(c.names), top),
        prefill_us=c.prefill_us if c.prefills else None,
        prefills=c.prefills,
        verify_steps=len(c.verify),
        verify_us=_span(c.verify),
        verify_kernel_launches=int(np.count_nonzero(verify_kind == _KERNEL_LAUNCH)),
        verify_graph_launches=int(np.count_nonzero(verify_kind == _GRAPH_LAUNCH)),
        draft_us=_span(c.draft),
        collective_kernels=collective_kernels,
        collective_time_us=collective_time,
        top_cpu_ops=top_cpu_ops,
        cpu_op_time_us=cpu_op_time,
    )


def summarize_trace(path: str | Path, top: int = 10) -> TraceSummary:
    """Summarize the torch.profiler Chrome trace at ``path`` over the first scope that applies: its decode
    phase, its ProfilerStep#N steps, or the whole trace (see the module's docstring).

    ``path`` may be gzipped. Raises FileNotFoundError for a missing file and ValueError (one line, naming
    the file) for malformed or unbounded JSON (see _GuardedReader), a JSON file that is not a trace, or a
    ``gpt-fast generate --profile`` trace with a prefill but no decode marks.
    """
    path = Path(path)
    return _summarize(_read(path), path, top)


def _time(us: float) -> str:
    if us < 1_000:
        return f"{us:.0f} µs"
    if us < 1_000_000:
        return f"{us / 1_000:.1f} ms"
    return f"{us / 1_000_000:.2f} s"


def _short_name(name: str, width: int = 100) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def _scope_line(s: TraceSummary) -> str:
    if s.scope == SCOPE_WHOLE:
        return (
            f"scope: whole trace (no {DECODE_MARK!r} or {STEP_MARK_PREFIX}N marks), "
            f"{_time(s.wall_us)} from first to last event"
        )
    marks = {SCOPE_DECODE: DECODE_MARK, SCOPE_SPECULATIVE: VERIFY_MARK}
    name = repr(marks[s.scope]) if s.scope in marks else f"{STEP_MARK_PREFIX}N"
    return (
        f"scope: {s.scope}, per {name} mark: {_how_many(s)}, "
        f"{_time(s.wall_us)} wall ({_time(s.per_unit(s.wall_us))}/{s.unit_name})"
    )


def _how_many(s: TraceSummary) -> str:
    """'4 tokens', '1 step'."""
    return f"{s.units} {s.unit_name}{'' if s.units == 1 else 's'}"


def _figure(s: TraceSummary, count: int) -> str:
    """A count per unit ('3.0'), or as it is over the whole trace."""
    return str(count) if s.scope == SCOPE_WHOLE else f"{s.per_unit(count):.1f}"


def _figures(s: TraceSummary, what: str, *pairs: tuple[int, str]) -> str:
    """'WHAT per token: 3.0 kernel, 0.0 graph (12 kernel, 0 graph in total)', or 'WHAT: 12 kernel, 0 graph'."""
    totals = ", ".join(f"{n} {name}" for n, name in pairs)
    if s.scope == SCOPE_WHOLE:
        return f"{what}: {totals}"
    return (
        f"{what} per {s.unit_name}: "
        + ", ".join(f"{_figure(s, n)} {name}" for n, name in pairs)
        + f" ({totals} in total)"
    )


def _gpu_lines(s: TraceSummary) -> list[str]:
    if s.busy_fraction is None or s.gpu_window_us is None:
        if not s.top_cpu_ops:
            return [f"GPU: no kernels in {_SCOPE_PHRASES[s.scope]} (CPU-only trace?)"]
        share = s.cpu_op_time_us
        return [
            f"GPU: no kernels in {_SCOPE_PHRASES[s.scope]} (a CPU trace); CPU operators' self time "
            f"{_time(s.cpu_op_time_us)}",
            f"top operators by CPU self time ({len(s.top_cpu_ops)}):",
            *(
                f"  {t / share if share else 0:6.1%} {_time(t):>10} x{c:<7} {_short_name(n)}"
                for n, c, t in s.top_cpu_ops
            ),
        ]
    lines = [
        _figures(s, "GPU", (s.gpu_kernels, "kernels"), (s.gpu_memcpys, "memcpy"), (s.gpu_memsets, "memset")),
        f"GPU busy: {s.busy_fraction:.1%} of a {_time(s.gpu_window_us)} window from first to last kernel "
        f"(kernel time {_time(s.kernel_time_us)})",
    ]
    if s.collective_kernels:
        lines.append(
            _figures(s, "collectives", (s.collective_kernels, "kernels"))
            + f", {_time(s.per_unit(s.collective_time_us))}{'' if s.scope == SCOPE_WHOLE else '/' + s.unit_name} "
            f"({s.kernel_share(s.collective_time_us):.1%} of kernel time)"
        )
    gaps = ", ".join(f"{_time(g)} at +{_time(o)}" for o, g in s.largest_gaps)
    lines.append(f"largest idle gaps: {gaps or 'none'}")
    lines.append(f"top kernels by GPU time ({len(s.top_kernels)}):")
    lines += [f"  {s.kernel_share(t):6.1%} {_time(t):>10} x{c:<7} {_short_name(name)}" for name, c, t in s.top_kernels]
    return lines


def format_summary(s: TraceSummary) -> str:
    """Plain-text, multi-line report of a TraceSummary; its second line names the scope."""
    lines = [f"trace: {s.path}", _scope_line(s)]
    if s.scope in (SCOPE_DECODE, SCOPE_SPECULATIVE):
        prefill = (
            f"{_time(s.prefill_us)} ({s.prefills} mark{'s' if s.prefills != 1 else ''})"
            if s.prefill_us is not None
            else f"not marked ({PREFILL_MARK!r})"
        )
        lines.append(f"prefill: {prefill}")
    if s.verify_steps:
        lines.append(_verify_line(s))
    lines.append(_figures(s, "runtime launches", (s.kernel_launches, "kernel"), (s.graph_launches, "graph")))
    return "\n".join(lines + _gpu_lines(s))


def _verify_line(s: TraceSummary) -> str:
    """The verify steps' own figures: their wall time and launches, and the drafting's wall time."""
    steps = s.verify_steps
    return (
        f"verify steps: {steps}, {_time(s.verify_us / steps)} wall each, {s.verify_graph_launches / steps:.2f} "
        f"graph and {s.verify_kernel_launches / steps:.1f} kernel launches each; drafting {_time(s.draft_us / steps)} "
        "wall per verify step"
    )


def short_summary(s: TraceSummary) -> str:
    """Exactly two lines: the scope with launches and kernels per unit, then GPU busy and largest gap."""
    head = f"{s.scope}:" if s.scope == SCOPE_WHOLE else f"{s.scope}: {_how_many(s)},"
    per = "" if s.scope == SCOPE_WHOLE else f"/{s.unit_name}"
    first = (
        f"{head} {_figure(s, s.kernel_launches)} kernel launches{per}, "
        f"{_figure(s, s.graph_launches)} graph launches{per}, {_figure(s, s.gpu_kernels)} GPU kernels{per}"
    )
    phrase = _SCOPE_PHRASES[s.scope]
    if s.busy_fraction is None:
        if not s.top_cpu_ops:
            return f"{first}\nGPU: no kernels in {phrase}"
        ops = ", ".join(
            f"{name} {t / s.cpu_op_time_us if s.cpu_op_time_us else 0:.0%}" for name, _, t in s.top_cpu_ops[:3]
        )
        return f"{first}\nCPU trace: top operators by self time in {phrase}: {ops}"
    gap = f"largest idle gap {_time(s.largest_gaps[0][1])}" if s.largest_gaps else "no idle gaps"
    return f"{first}\nGPU busy {s.busy_fraction:.1%} of {phrase}; {gap}"
