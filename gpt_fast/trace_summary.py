"""Decode-phase summary of a Chrome trace written by ``torch.profiler``.

While profiling, the generator wraps the prefill in
``torch.profiler.record_function(PREFILL_MARK)`` and every decode step in
``torch.profiler.record_function(DECODE_MARK)``; ``prof.export_chrome_trace`` turns those
into ``ph: "X"`` events of category ``user_annotation``. This module reads such a trace
and reports, for the decode phase: tokens, runtime kernel/graph launches per token, GPU
kernels per token, how busy the GPU was, its largest idle gaps and the kernels that took
the time.

Attribution follows kineto's trace format: a runtime or driver call (``cuda_runtime`` /
``cuda_driver``; ROCm's HIP calls are also written as ``cuda_runtime``) belongs to decode
when its start lies inside a decode mark of the same process; a GPU kernel, memcpy or
memset belongs to decode when its ``args.correlation`` is that of a decode-phase call.
Every kernel of a CUDA/HIP graph replay carries the correlation id of the graph launch.
GPU events without a correlation id fall back to time (see TIME_FALLBACK_SLACK_US).

Traces can be hundreds of MB, so the file (plain or gzip) is streamed with ijson in one
pass and only compact columns (``array``/numpy) of the relevant events are kept.
"""

from __future__ import annotations

import gzip
import re
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import ijson
import numpy as np

from gpt_fast.fileio import first_line
from gpt_fast.profiling import DECODE_MARK, PREFILL_MARK

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
GPU_MARK_CATEGORY = "gpu_user_annotation"
KERNEL, MEMCPY, MEMSET = 0, 1, 2
# Old kineto versions wrote "Kernel".
GPU_CATEGORIES = {"kernel": KERNEL, "Kernel": KERNEL, "gpu_memcpy": MEMCPY, "gpu_memset": MEMSET}

# GPU events without a correlation id count as decode when they start between the first
# decode mark's start and the last one's end plus this much (the GPU lags the CPU).
TIME_FALLBACK_SLACK_US = 10_000.0
LARGEST_GAPS = 5

_NO_CORRELATION = -1
_OTHER_CALL, _KERNEL_LAUNCH, _GRAPH_LAUNCH = 0, 1, 2
_CALL_CODES = {"kernel": _KERNEL_LAUNCH, "graph": _GRAPH_LAUNCH}
_GZIP_MAGIC = b"\x1f\x8b"


@lru_cache(maxsize=4096)
def launch_kind(name: str) -> str | None:
    """Return "kernel" or "graph" for a launch API name (suffixes ignored), else None."""
    base = _API_SUFFIX.sub("", name)
    if base in KERNEL_LAUNCH_APIS:
        return "kernel"
    if base in GRAPH_LAUNCH_APIS:
        return "graph"
    return None


@dataclass(frozen=True)
class TraceSummary:
    """Decode-phase figures of one trace; times are in microseconds."""

    path: str
    tokens: int
    kernel_launches: int
    graph_launches: int
    gpu_kernels: int
    gpu_memcpys: int
    gpu_memsets: int
    kernel_time_us: float
    busy_fraction: float | None
    decode_window_us: float | None  # first decode kernel start to last decode kernel end
    decode_wall_us: float  # first decode mark start to last decode mark end (CPU)
    largest_gaps: tuple[tuple[float, float], ...]  # (offset in window, gap), largest first
    top_kernels: tuple[tuple[str, int, float], ...]  # (name, count, total), largest first
    prefill_us: float | None  # wall time of all prefill marks together; None if unmarked
    prefills: int

    @property
    def kernel_launches_per_token(self) -> float:
        return self.kernel_launches / self.tokens

    @property
    def graph_launches_per_token(self) -> float:
        return self.graph_launches / self.tokens

    @property
    def gpu_kernels_per_token(self) -> float:
        return self.gpu_kernels / self.tokens

    def kernel_share(self, total_us: float) -> float:
        """Fraction of the decode kernel time that ``total_us`` represents."""
        return total_us / self.kernel_time_us if self.kernel_time_us > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for ``--json``), per-token figures included."""
        out = asdict(self)
        out["kernel_launches_per_token"] = self.kernel_launches_per_token
        out["graph_launches_per_token"] = self.graph_launches_per_token
        out["gpu_kernels_per_token"] = self.gpu_kernels_per_token
        out["largest_gaps"] = [{"offset_us": o, "gap_us": g} for o, g in self.largest_gaps]
        out["top_kernels"] = [
            {"name": n, "count": c, "total_us": t, "share": self.kernel_share(t)} for n, c, t in self.top_kernels
        ]
        return out


class _Columns:
    """Compact columns of the events the summary needs; all else is dropped as read."""

    def __init__(self) -> None:
        self.events = 0
        self.pids: dict[Any, int] = {}
        self.names: dict[str, int] = {}
        self.mark_pid, self.mark_start, self.mark_end = array("q"), array("d"), array("d")
        self.prefills, self.prefill_us = 0, 0.0
        self.call_pid, self.call_ts = array("q"), array("d")
        self.call_corr, self.call_kind = array("q"), array("b")
        self.gpu_kind, self.gpu_corr, self.gpu_name = array("b"), array("q"), array("q")
        self.gpu_start, self.gpu_dur = array("d"), array("d")

    def add(self, event: Any) -> None:
        self.events += 1
        if not isinstance(event, dict) or event.get("ph") != "X":
            return
        name, ts = event.get("name"), event.get("ts")
        if not isinstance(name, str) or not isinstance(ts, (int, float)):
            return
        cat = event.get("cat")
        cat = cat if isinstance(cat, str) else ""
        if cat in GPU_CATEGORIES:
            self._add_gpu(event, GPU_CATEGORIES[cat], name, ts)
        elif name in (DECODE_MARK, PREFILL_MARK):
            if cat != GPU_MARK_CATEGORY:
                self._add_mark(event, name, ts)
        else:
            kind = launch_kind(name)
            if kind is not None or cat in RUNTIME_CATEGORIES:
                self._add_call(event, kind, ts)

    def _pid(self, event: dict[str, Any]) -> int:
        pid = event.get("pid")
        key = pid if isinstance(pid, (int, str)) else repr(pid)
        return self.pids.setdefault(key, len(self.pids))

    def _add_mark(self, event: dict[str, Any], name: str, ts: float) -> None:
        dur = _duration(event)
        if name == PREFILL_MARK:
            self.prefills += 1
            self.prefill_us += dur
            return
        self.mark_pid.append(self._pid(event))
        self.mark_start.append(ts)
        self.mark_end.append(ts + dur)

    def _add_call(self, event: dict[str, Any], kind: str | None, ts: float) -> None:
        self.call_pid.append(self._pid(event))
        self.call_ts.append(ts)
        self.call_corr.append(_correlation(event))
        self.call_kind.append(_CALL_CODES.get(kind, _OTHER_CALL))

    def _add_gpu(self, event: dict[str, Any], kind: int, name: str, ts: float) -> None:
        self.gpu_kind.append(kind)
        self.gpu_corr.append(_correlation(event))
        self.gpu_name.append(self.names.setdefault(name, len(self.names)))
        self.gpu_start.append(ts)
        self.gpu_dur.append(_duration(event))


def _duration(event: dict[str, Any]) -> float:
    dur = event.get("dur")
    return float(dur) if isinstance(dur, (int, float)) and dur > 0 else 0.0


def _correlation(event: dict[str, Any]) -> int:
    args = event.get("args")
    corr = args.get("correlation") if isinstance(args, dict) else None
    return int(corr) if isinstance(corr, (int, float)) else _NO_CORRELATION


def _events(path: Path) -> Iterator[Any]:
    """Stream the items of the top-level ``traceEvents`` array of a (gzipped) JSON file."""
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with path.open("rb") as raw:
        gzipped = raw.read(2) == _GZIP_MAGIC
        raw.seek(0)
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw
        try:
            yield from ijson.items(stream, "traceEvents.item", use_float=True)
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
    if not columns.mark_start:
        raise ValueError(
            f"{path}: the trace has no {DECODE_MARK!r} marks (was it written by `gpt-fast generate --profile`?)"
        )
    return columns


def _inside_marks(pid: np.ndarray, ts: np.ndarray, c: _Columns) -> np.ndarray:
    """Mask of the (pid, ts) points that lie inside a decode mark of the same pid."""
    mark_pid, start, end = (np.asarray(a) for a in (c.mark_pid, c.mark_start, c.mark_end))
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


def _decode_gpu_mask(c: _Columns, decode_corr: np.ndarray) -> np.ndarray:
    corr, start = np.asarray(c.gpu_corr), np.asarray(c.gpu_start)
    by_corr = np.isin(corr, decode_corr)
    lo = min(c.mark_start)
    hi = max(c.mark_end) + TIME_FALLBACK_SLACK_US
    by_time = (corr == _NO_CORRELATION) & (start >= lo) & (start <= hi)
    return by_corr | by_time


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


def _summarize(c: _Columns, path: Path, top: int) -> TraceSummary:
    call_in = _inside_marks(np.asarray(c.call_pid), np.asarray(c.call_ts), c)
    call_kind = np.asarray(c.call_kind)[call_in]
    call_corr = np.asarray(c.call_corr)[call_in]
    gpu_in = _decode_gpu_mask(c, np.unique(call_corr[call_corr != _NO_CORRELATION]))
    gpu_kind = np.asarray(c.gpu_kind)
    kernels = gpu_in & (gpu_kind == KERNEL)
    start, dur = np.asarray(c.gpu_start)[kernels], np.asarray(c.gpu_dur)[kernels]
    busy, window, gaps = _idle_profile(start, start + dur)
    return TraceSummary(
        path=str(path),
        tokens=len(c.mark_start),
        kernel_launches=int(np.count_nonzero(call_kind == _KERNEL_LAUNCH)),
        graph_launches=int(np.count_nonzero(call_kind == _GRAPH_LAUNCH)),
        gpu_kernels=int(np.count_nonzero(kernels)),
        gpu_memcpys=int(np.count_nonzero(gpu_in & (gpu_kind == MEMCPY))),
        gpu_memsets=int(np.count_nonzero(gpu_in & (gpu_kind == MEMSET))),
        kernel_time_us=float(dur.sum()),
        busy_fraction=busy,
        decode_window_us=window,
        decode_wall_us=max(c.mark_end) - min(c.mark_start),
        largest_gaps=gaps,
        top_kernels=_top_kernels(np.asarray(c.gpu_name)[kernels], dur, list(c.names), top),
        prefill_us=c.prefill_us if c.prefills else None,
        prefills=c.prefills,
    )


def summarize_trace(path: str | Path, top: int = 10) -> TraceSummary:
    """Summarize the decode phase of the torch.profiler Chrome trace at ``path``.

    ``path`` may be gzipped. Raises FileNotFoundError for a missing file and ValueError
    (one line, naming the file) for malformed JSON, a JSON file that is not a trace, or
    a trace without DECODE_MARK events.
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


def _gpu_lines(s: TraceSummary) -> list[str]:
    if s.busy_fraction is None or s.decode_window_us is None:
        return ["GPU: no kernels in the decode phase (CPU-only trace?)"]
    n = s.tokens
    lines = [
        f"GPU per token: {s.gpu_kernels_per_token:.1f} kernels, {s.gpu_memcpys / n:.1f} "
        f"memcpy, {s.gpu_memsets / n:.1f} memset ({s.gpu_kernels} kernels in total)",
        f"GPU busy: {s.busy_fraction:.1%} of a {_time(s.decode_window_us)} decode window "
        f"(kernel time {_time(s.kernel_time_us)})",
    ]
    gaps = ", ".join(f"{_time(g)} at +{_time(o)}" for o, g in s.largest_gaps)
    lines.append(f"largest idle gaps: {gaps or 'none'}")
    lines.append(f"top kernels by GPU time ({len(s.top_kernels)}):")
    lines += [f"  {s.kernel_share(t):6.1%} {_time(t):>10} x{c:<7} {_short_name(name)}" for name, c, t in s.top_kernels]
    return lines


def format_summary(s: TraceSummary) -> str:
    """Plain-text, multi-line report of a TraceSummary."""
    prefill = (
        f"{_time(s.prefill_us)} ({s.prefills} mark{'s' if s.prefills != 1 else ''})"
        if s.prefill_us is not None
        else f"not marked ({PREFILL_MARK!r})"
    )
    lines = [
        f"trace: {s.path}",
        f"decode: {s.tokens} tokens, {_time(s.decode_wall_us)} wall ({_time(s.decode_wall_us / s.tokens)}/token)",
        f"prefill: {prefill}",
        f"runtime launches per token: {s.kernel_launches_per_token:.1f} kernel, "
        f"{s.graph_launches_per_token:.1f} graph ({s.kernel_launches} kernel, "
        f"{s.graph_launches} graph in total)",
    ]
    return "\n".join(lines + _gpu_lines(s))


def short_summary(s: TraceSummary) -> str:
    """Exactly two lines: launches/kernels per token, then GPU busy and largest gap."""
    first = (
        f"decode: {s.tokens} tokens, {s.kernel_launches_per_token:.1f} kernel launches/token, "
        f"{s.graph_launches_per_token:.1f} graph launches/token, "
        f"{s.gpu_kernels_per_token:.1f} GPU kernels/token"
    )
    if s.busy_fraction is None:
        return f"{first}\nGPU: no kernels in the decode phase"
    gap = f"largest idle gap {_time(s.largest_gaps[0][1])}" if s.largest_gaps else "no idle gaps"
    return f"{first}\nGPU busy {s.busy_fraction:.1%} of decode; {gap}"
