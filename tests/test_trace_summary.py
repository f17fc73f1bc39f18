"""Tests for gpt_fast.trace_summary on synthetic kineto-style traces and a real CPU trace."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from gpt_fast.trace_summary import (
    DECODE_MARK,
    PREFILL_MARK,
    TIME_FALLBACK_SLACK_US,
    format_summary,
    launch_kind,
    short_summary,
    summarize_trace,
)

PID = 4242  # the profiled process; GPU events use the device id as pid


def mark(name: str, ts: float, dur: float, pid: int = PID, cat: str = "user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": pid, "ts": ts, "dur": dur}


def call(name: str, ts: float, corr: int | None, cat: str = "cuda_runtime", pid: int = PID):
    args = {} if corr is None else {"cbid": 211, "correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": 7, "ts": ts, "dur": 4, "args": args}


def gpu(name: str, ts: float, dur: float, corr: int | None, cat: str = "kernel"):
    # The args kineto writes for a CUDA kernel, so that the file has a realistic size.
    args = {
        "queued": 0,
        "device": 0,
        "context": 1,
        "stream": 7,
        "registers per thread": 128,
        "shared memory": 49152,
        "blocks per SM": 1.5,
        "warps per SM": 12.0,
        "grid": [198, 1, 1],
        "block": [256, 1, 1],
        "est. achieved occupancy %": 19,
    }
    if corr is not None:
        args["correlation"] = corr
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur, "args": args}


def write_trace(path: Path, events: list[dict[str, Any]]) -> Path:
    doc = {"schemaVersion": 1, "deviceProperties": [], "traceEvents": events, "traceName": str(path)}
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        json.dump(doc, f)
    return path


def noise() -> list[dict[str, Any]]:
    """Events that must not count: prefill work, other processes, GPU mirrors, flows."""
    return [
        mark(PREFILL_MARK, 0, 90),
        call("cudaLaunchKernel", 10, 10_000_001),
        gpu("prefill_gemm", 20, 50, 10_000_001),
        call("cudaLaunchKernel", 5000, 10_000_002),  # after decode, outside any mark
        gpu("late_kernel", 5010, 10, 10_000_002),
        call("cudaLaunchKernel", 150, 10_000_003, pid=PID + 1),  # inside a mark's time, other pid
        gpu("other_process_kernel", 160, 10, 10_000_003),
        mark(DECODE_MARK, 100, 500, pid=0, cat="gpu_user_annotation"),
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::mm",
            "pid": PID,
            "tid": PID,
            "ts": 110,
            "dur": 3,
            "args": {"External id": 3},
        },
        {"ph": "s", "id": 1, "pid": PID, "tid": 7, "ts": 110, "cat": "ac2g", "name": "ac2g"},
        {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": 6000},
    ]


EAGER_KERNELS = ["gemm", "rope", "gemm"]


def eager_events(tokens: int, launch_names: list[str], correlated: bool = True):
    """Token i: a mark at 1000*i+100 (500 µs) holding one launch per name, kernel j of
    token i running at 1000*i+200+50*j for 40 µs, plus a memcpy and a memset."""
    events = []
    for i in range(tokens):
        base = 1000 * i
        events.append(mark(DECODE_MARK, base + 100, 500))
        for j, name in enumerate(launch_names):
            corr = 100 * i + j + 1
            cat = "cuda_driver" if name.startswith("cuLaunch") else "cuda_runtime"
            events.append(call(name, base + 110 + 20 * j, corr, cat=cat))
            kname = EAGER_KERNELS[j % len(EAGER_KERNELS)]
            events.append(gpu(kname, base + 200 + 50 * j, 40, corr if correlated else None))
        events.append(call("cudaMemcpyAsync", base + 400, 100 * i + 90))
        events.append(
            gpu("Memcpy DtoH (Device -> Pinned)", base + 360, 2, 100 * i + 90 if correlated else None, cat="gpu_memcpy")
        )
        events.append(call("cudaMemsetAsync", base + 410, 100 * i + 91))
        events.append(gpu("Memset (Device)", base + 180, 1, 100 * i + 91, cat="gpu_memset"))
    return events


def check_eager(s, tokens: int = 4) -> None:
    assert s.tokens == tokens
    assert (s.kernel_launches, s.graph_launches) == (3 * tokens, 0)
    assert s.kernel_launches_per_token == 3.0
    assert s.gpu_kernels == 3 * tokens
    assert s.gpu_kernels_per_token == 3.0
    assert (s.gpu_memcpys, s.gpu_memsets) == (tokens, tokens)
    # Kernels of token i cover [200, 240), [250, 290), [300, 340) + 1000*i.
    window = 1000 * (tokens - 1) + 340 - 200
    assert s.decode_window_us == pytest.approx(window)
    assert s.kernel_time_us == pytest.approx(120 * tokens)
    assert s.busy_fraction == pytest.approx(120 * tokens / window)
    assert s.largest_gaps == ((140, 860), (1140, 860), (2140, 860), (40, 10), (90, 10))
    assert s.top_kernels == (("gemm", 2 * tokens, 80.0 * tokens), ("rope", tokens, 40.0 * tokens))
    assert s.prefill_us == 90 and s.prefills == 1
    assert s.decode_wall_us == pytest.approx(1000 * (tokens - 1) + 500)


CUDA_EAGER = ["cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernel_ptsz"]
HIP_EAGER = ["hipLaunchKernel", "hipExtModuleLaunchKernel", "hipModuleLaunchKernel"]


@pytest.mark.parametrize("launch_names", [CUDA_EAGER, HIP_EAGER], ids=["cuda", "hip"])
def test_eager_trace_counts_gaps_and_top_kernels(tmp_path, launch_names):
    path = write_trace(tmp_path / "eager.json", noise() + eager_events(4, launch_names))
    check_eager(summarize_trace(path))


def test_gzip_trace_matches_plain(tmp_path):
    events = noise() + eager_events(4, CUDA_EAGER)
    plain = summarize_trace(write_trace(tmp_path / "t.json", events))
    packed = summarize_trace(write_trace(tmp_path / "t.json.gz", events))
    check_eager(packed)
    assert packed.to_dict() | {"path": ""} == plain.to_dict() | {"path": ""}


def graph_events(tokens: int, per_graph: int, launch: str) -> list[dict[str, Any]]:
    """One graph launch per token; its per_graph kernels share its correlation id and run
    back to back (10 µs each) from 1000*i+200, the first two on two overlapping streams."""
    events = []
    for i in range(tokens):
        base, corr = 1000 * i, 500 + i
        events += [mark(DECODE_MARK, base + 100, 500), call(launch, base + 120, corr)]
        events += [gpu(f"node{j % 2}", base + 200 + 10 * j, 10, corr) for j in range(per_graph)]
        events.append(gpu("node_side", base + 205, 10, corr))  # overlaps node0 and node1
    return events


@pytest.mark.parametrize("launch", ["cudaGraphLaunch", "hipGraphLaunch", "cudaGraphLaunch_ptsz"])
def test_graph_trace_shares_correlation_ids(tmp_path, launch):
    path = write_trace(tmp_path / "graph.json", noise() + graph_events(4, 5, launch))
    s = summarize_trace(path)
    assert (s.tokens, s.kernel_launches, s.graph_launches) == (4, 0, 4)
    assert s.graph_launches_per_token == 1.0
    assert s.gpu_kernels == 4 * 6 and s.gpu_kernels_per_token == 6.0
    # Union per token is [200, 250): 50 µs busy; window 200 .. 3250.
    assert s.decode_window_us == pytest.approx(3050)
    assert s.busy_fraction == pytest.approx(200 / 3050)
    assert s.largest_gaps == ((50, 950), (1050, 950), (2050, 950))
    assert s.top_kernels[0] == ("node0", 12, 120.0)
    assert short_summary(s).splitlines() == [
        "decode: 4 tokens, 0.0 kernel launches/token, 1.0 graph launches/token, 6.0 GPU kernels/token",
        "GPU busy 6.6% of decode; largest idle gap 950 µs",
    ]


def test_kernels_without_correlation_fall_back_to_time(tmp_path):
    events = eager_events(4, CUDA_EAGER, correlated=False)
    events += [
        gpu("before_decode", 50, 10, None),
        gpu("in_slack", 3600 + TIME_FALLBACK_SLACK_US - 1, 1, None),
        gpu("after_slack", 3600 + TIME_FALLBACK_SLACK_US + 1, 1, None),
    ]
    s = summarize_trace(write_trace(tmp_path / "nocorr.json", events))
    assert s.gpu_kernels == 4 * 3 + 1
    assert s.gpu_memcpys == 4
    assert "before_decode" not in {name for name, _, _ in s.top_kernels}


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("cudaLaunchKernel", "kernel"),
        ("cudaLaunchKernelExC_v11060", "kernel"),
        ("cuLaunchKernelEx", "kernel"),
        ("cudaLaunchCooperativeKernel_ptsz", "kernel"),
        ("hipLaunchKernel_spt", "kernel"),
        ("hipExtLaunchKernel", "kernel"),
        ("hipLaunchCooperativeKernel", "kernel"),
        ("cudaGraphLaunch_v10000", "graph"),
        ("cuGraphLaunch_ptsz", "graph"),
        ("hipGraphLaunch_spt", "graph"),
        ("cudaLaunchHostFunc", None),
        ("cudaGraphLaunchFoo", None),
        ("cudaMemcpyAsync", None),
        ("aten::mm", None),
        ("xcudaLaunchKernel", None),
    ],
)
def test_launch_kind_matches_exact_names_after_suffixes(name, kind):
    assert launch_kind(name) == kind


def test_report_formats(tmp_path):
    s = summarize_trace(write_trace(tmp_path / "t.json", noise() + eager_events(4, HIP_EAGER)))
    text = format_summary(s)
    assert len(text.splitlines()) > 5
    assert "4 tokens" in text and "gemm" in text and "66.7%" in text and "860 µs" in text
    assert len(short_summary(s).splitlines()) == 2
    back = json.loads(json.dumps(s.to_dict()))
    assert back["kernel_launches_per_token"] == 3.0
    assert back["top_kernels"][0] == {"name": "gemm", "count": 8, "total_us": 320.0, "share": pytest.approx(2 / 3)}
    assert back["largest_gaps"][0] == {"offset_us": 140, "gap_us": 860}


def test_kernel_less_cpu_style_trace(tmp_path):
    events = [mark(DECODE_MARK, 100 * i, 50) for i in range(5)]
    s = summarize_trace(write_trace(tmp_path / "cpu.json", events))
    assert s.tokens == 5
    assert (s.kernel_launches, s.graph_launches, s.gpu_kernels) == (0, 0, 0)
    assert s.busy_fraction is None and s.decode_window_us is None
    assert s.largest_gaps == () and s.top_kernels == () and s.prefill_us is None
    assert "no kernels" in format_summary(s)
    assert len(short_summary(s).splitlines()) == 2


def test_real_cpu_profiler_trace(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(PREFILL_MARK):
            y = x @ x
        for _ in range(3):
            with record_function(DECODE_MARK):
                y = y @ x
    path = tmp_path / "real.json"
    prof.export_chrome_trace(str(path))
    s = summarize_trace(path)
    assert s.tokens == 3
    assert (s.kernel_launches, s.graph_launches, s.gpu_kernels) == (0, 0, 0)
    assert s.busy_fraction is None
    assert s.prefills == 1 and s.prefill_us is not None and s.prefill_us > 0


def test_streams_without_json_load(tmp_path, monkeypatch):
    path = write_trace(tmp_path / "big.json", noise() + eager_events(1500, CUDA_EAGER))
    # Warm up first so that numpy's lazy imports do not count towards the peak.
    summarize_trace(write_trace(tmp_path / "small.json", noise() + eager_events(2, CUDA_EAGER)))

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the trace must be streamed, not loaded whole")

    monkeypatch.setattr(json, "load", refuse)
    monkeypatch.setattr(json, "loads", refuse)
    tracemalloc.start()
    try:
        s = summarize_trace(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert s.tokens == 1500 and s.gpu_kernels == 4500 and s.kernel_launches == 4500
    # Parsed events held in a list would take several times the file's size (~1 KB per
    # dict against ~150 bytes of JSON); the compact columns take a fraction of it.
    assert peak < path.stat().st_size / 2


def assert_one_line_error(excinfo: pytest.ExceptionInfo, path: Path, *words: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message and str(path) in message
    for word in words:
        assert word in message


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError) as excinfo:
        summarize_trace(path)
    assert_one_line_error(excinfo, path, "not found")


@pytest.mark.parametrize(
    "content",
    [b'{"traceEvents": [{"ph": "X", "name": ', b"", b'{"traceEvents": [\xff]}', b'{"traceEvents": []} trailing'],
    ids=["truncated", "empty", "bad-bytes", "trailing"],
)
def test_malformed_json(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as excinfo:
        summarize_trace(path)
    assert_one_line_error(excinfo, path, "malformed JSON")


def test_corrupt_gzip(tmp_path):
    path = tmp_path / "bad.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": []}')[:-12])
    with pytest.raises(ValueError) as excinfo:
        summarize_trace(path)
    assert_one_line_error(excinfo, path, "gzip")


@pytest.mark.parametrize("doc", [{"name": "not a trace"}, [1, 2, 3], {"traceEvents": []}])
def test_json_that_is_not_a_trace(tmp_path, doc):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as excinfo:
        summarize_trace(path)
    assert_one_line_error(excinfo, path, "not a Chrome trace", "traceEvents")


def test_trace_without_decode_marks(tmp_path):
    events = [mark(PREFILL_MARK, 0, 10), mark(DECODE_MARK, 0, 10, cat="gpu_user_annotation")]
    path = write_trace(tmp_path / "nodecode.json", events)
    with pytest.raises(ValueError) as excinfo:
        summarize_trace(path)
    assert_one_line_error(excinfo, path, DECODE_MARK, "gpt-fast generate --profile")
