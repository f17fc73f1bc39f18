"""Tests for gpt_fast.jobs.trace_summary on synthetic kineto-style traces and a real CPU trace."""

from __future__ import annotations

import gzip
import json
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest

from gpt_fast.cli.main import main
from gpt_fast.jobs import trace_summary
from gpt_fast.jobs.trace_summary import (
    DECODE_MARK,
    DRAFT_MARK,
    PREFILL_MARK,
    SCOPE_DECODE,
    SCOPE_SPECULATIVE,
    SCOPE_STEPS,
    SCOPE_WHOLE,
    TIME_FALLBACK_SLACK_US,
    VERIFY_MARK,
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
    """Events that must not count in decode: prefill work, and the outsiders below."""
    return [mark(PREFILL_MARK, 0, 90), *outsiders()]


def outsiders() -> list[dict[str, Any]]:
    """Events that count in no scope delimited by marks: work before and after the marks (3 launches, 3 kernels
    in all), other processes, GPU mirrors of the marks, CPU ops, flows."""
    return [
        call("cudaLaunchKernel", 10, 10_000_001),
        gpu("prefill_gemm", 20, 50, 10_000_001),
        call("cudaLaunchKernel", 5000, 10_000_002),  # after decode, outside any mark
        gpu("late_kernel", 5010, 10, 10_000_002),
        call("cudaLaunchKernel", 150, 10_000_003, pid=PID + 1),  # inside a mark's time, other pid
        gpu("other_process_kernel", 160, 10, 10_000_003),
        mark(DECODE_MARK, 100, 500, pid=0, cat="gpu_user_annotation"),
        mark("ProfilerStep#0", 100, 500, pid=0, cat="gpu_user_annotation"),
        {"ph": "i", "name": "cudaLaunchKernel", "pid": PID, "tid": 7, "ts": 120},  # not a complete event
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


def eager_events(tokens: int, launch_names: list[str], correlated: bool = True, label: str | None = DECODE_MARK):
    """Token i: a mark named label.format(i=i) (none if label is None) at 1000*i+100 (500 µs) holding one launch
    per name, kernel j of token i running at 1000*i+200+50*j for 40 µs, plus a memcpy and a memset."""
    events = []
    for i in range(tokens):
        base = 1000 * i
        if label is not None:
            events.append(mark(label.format(i=i), base + 100, 500))
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


def eager_window(units: int) -> float:
    """Kernels of token i cover [200, 240), [250, 290), [300, 340) + 1000*i."""
    return 1000 * (units - 1) + 340 - 200


def check_eager_figures(s, units: int = 4) -> None:
    """What eager_events(units, ...) gives in a decode or ProfilerStep scope."""
    assert s.units == units
    assert (s.kernel_launches, s.graph_launches) == (3 * units, 0)
    assert s.gpu_kernels == 3 * units
    assert (s.gpu_memcpys, s.gpu_memsets) == (units, units)
    assert s.gpu_window_us == pytest.approx(eager_window(units))
    assert s.kernel_time_us == pytest.approx(120 * units)
    assert s.busy_fraction == pytest.approx(120 * units / eager_window(units))
    assert s.largest_gaps == ((140, 860), (1140, 860), (2140, 860), (40, 10), (90, 10))
    assert s.top_kernels == (("gemm", 2 * units, 80.0 * units), ("rope", units, 40.0 * units))
    assert s.wall_us == pytest.approx(1000 * (units - 1) + 500)


def check_eager(s, tokens: int = 4) -> None:
    check_eager_figures(s, tokens)
    assert s.scope == SCOPE_DECODE and s.unit == "token"
    assert s.tokens == tokens
    assert s.kernel_launches_per_token == 3.0
    assert s.gpu_kernels_per_token == 3.0
    assert s.decode_window_us == pytest.approx(eager_window(tokens))
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


def graph_events(
    tokens: int, per_graph: int, launch: str, label: str | None = DECODE_MARK, origin: float = 0
) -> list[dict[str, Any]]:
    """One graph launch per token (in a mark named label.format(i=i), none if label is None); its per_graph
    kernels share its correlation id and run back to back (10 µs each) from origin+1000*i+200, the first two
    on two overlapping streams."""
    events = []
    for i in range(tokens):
        base, corr = origin + 1000 * i, 500 + i
        if label is not None:
            events.append(mark(label.format(i=i), base + 100, 500))
        events.append(call(launch, base + 120, corr))
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


GPU_APIS = [(CUDA_EAGER, "cudaGraphLaunch"), (HIP_EAGER, "hipGraphLaunch")]


def profiler_span(ts: float, dur: float) -> dict[str, Any]:
    """The span kineto writes around the whole profiling window."""
    return {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "x", "ts": ts, "dur": dur}


@pytest.mark.parametrize(("launch_names", "graph_launch"), GPU_APIS, ids=["cuda", "hip"])
def test_trace_without_marks_is_summarized_whole(tmp_path, launch_names, graph_launch):
    events = [profiler_span(-50, 20_000), *outsiders(), *eager_events(4, launch_names, label=None)]
    events += graph_events(2, 5, graph_launch, label=None, origin=10_000)
    s = summarize_trace(write_trace(tmp_path / "whole.json", events))
    assert (s.scope, s.units, s.unit) == (SCOPE_WHOLE, 1, "trace")
    assert s.tokens is None and s.kernel_launches_per_token is None and s.decode_wall_us is None
    # Eager: 12 launches and kernels, 4 memcpy and memset; graphs: 2 launches, 6 kernels each; outsiders: 3 and 3.
    assert (s.kernel_launches, s.graph_launches) == (12 + 3, 2)
    assert (s.gpu_kernels, s.gpu_memcpys, s.gpu_memsets) == (12 + 12 + 3, 4, 4)
    # Kernels from prefill_gemm [20, 70) to the second graph's [11200, 11250); 650 µs of it busy.
    assert s.gpu_window_us == pytest.approx(11_230)
    assert s.busy_fraction == pytest.approx(650 / 11_230)
    assert s.largest_gaps == ((5000, 5180), (3320, 1670), (10_230, 950), (320, 860), (1320, 860))
    assert s.top_kernels[:5] == (
        ("gemm", 8, 320.0),
        ("rope", 4, 160.0),
        ("node0", 6, 60.0),
        ("prefill_gemm", 1, 50.0),
        ("node1", 4, 40.0),
    )
    assert s.kernel_time_us == pytest.approx(670)
    assert s.wall_us == pytest.approx(20_000) and s.prefill_us is None
    back = json.loads(json.dumps(s.to_dict()))
    assert (back["scope"], back["units"], back["unit"]) == ("whole trace", 1, "trace")
    assert not [key for key in back if "_per_" in key or key in ("tokens", "steps")]
    text = format_summary(s).splitlines()
    assert text[1].startswith("scope: whole trace (no 'gpt_fast::decode' or ProfilerStep#N marks), 20.0 ms")
    assert "runtime launches: 15 kernel, 2 graph" in text and "GPU: 27 kernels, 4 memcpy, 4 memset" in text
    assert short_summary(s).splitlines() == [
        "whole trace: 15 kernel launches, 2 graph launches, 27 GPU kernels",
        "GPU busy 5.8% of the trace; largest idle gap 5.2 ms",
    ]


@pytest.mark.parametrize("launch_names", [CUDA_EAGER, HIP_EAGER], ids=["cuda", "hip"])
def test_profiler_steps_without_decode_marks(tmp_path, launch_names):
    events = [profiler_span(-50, 20_000), *outsiders(), *eager_events(4, launch_names, label="ProfilerStep#{i}")]
    s = summarize_trace(write_trace(tmp_path / "steps.json", events))
    check_eager_figures(s, 4)
    assert (s.scope, s.unit, s.tokens, s.prefill_us) == (SCOPE_STEPS, "step", None, None)
    back = json.loads(json.dumps(s.to_dict()))
    assert (back["scope"], back["steps"], back["kernel_launches_per_step"], back["gpu_kernels_per_step"]) == (
        "ProfilerStep",
        4,
        3.0,
        3.0,
    )
    assert "tokens" not in back and "kernel_launches_per_token" not in back
    text = format_summary(s).splitlines()
    assert text[1] == "scope: ProfilerStep, per ProfilerStep#N mark: 4 steps, 3.5 ms wall (875 µs/step)"
    assert "runtime launches per step: 3.0 kernel, 0.0 graph (12 kernel, 0 graph in total)" in text
    assert short_summary(s).splitlines() == [
        "ProfilerStep: 4 steps, 3.0 kernel launches/step, 0.0 graph launches/step, 3.0 GPU kernels/step",
        "GPU busy 15.3% of the profiler steps; largest idle gap 860 µs",
    ]


@pytest.mark.parametrize("launch", ["cudaGraphLaunch", "hipGraphLaunch"])
def test_profiler_steps_with_graph_launches(tmp_path, launch):
    events = outsiders() + graph_events(4, 5, launch, label="ProfilerStep#{i}")
    s = summarize_trace(write_trace(tmp_path / "graph_steps.json", events))
    assert (s.scope, s.units, s.kernel_launches, s.graph_launches, s.gpu_kernels) == (SCOPE_STEPS, 4, 0, 4, 24)
    assert s.to_dict()["graph_launches_per_step"] == 1.0
    assert s.busy_fraction == pytest.approx(200 / 3050)
    assert s.largest_gaps == ((50, 950), (1050, 950), (2050, 950))


def test_decode_marks_take_precedence_over_profiler_steps(tmp_path):
    events = noise() + eager_events(4, CUDA_EAGER) + [mark("ProfilerStep#0", 0, 6000)]
    check_eager(summarize_trace(write_trace(tmp_path / "both.json", events)))


def test_cli_names_the_scope(tmp_path, capsys):
    path = write_trace(tmp_path / "steps.json", eager_events(2, HIP_EAGER, label="ProfilerStep#{i}"))
    with pytest.raises(SystemExit) as exit_info:
        main(["trace-summary", str(path)])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "scope: ProfilerStep, per ProfilerStep#N mark: 2 steps" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["trace-summary", str(path), "--json"])
    assert exit_info.value.code == 0 and json.loads(capsys.readouterr().out)["scope"] == "ProfilerStep"


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


def speculative_events(rounds: int) -> list[dict[str, Any]]:
    """Round i: a draft mark at 1000*i+100 (200 µs) launching 2 kernels one by one, then a verify mark at
    1000*i+400 (300 µs) launching one graph of 5 kernels."""
    events = []
    for i in range(rounds):
        base, corr = 1000 * i, 100 * i
        events += [mark(DRAFT_MARK, base + 100, 200), mark(VERIFY_MARK, base + 400, 300)]
        for j in range(2):
            events += [call("cudaLaunchKernel", base + 110 + 10 * j, corr + j), gpu("draft", base + 150, 20, corr + j)]
        events += [call("cudaGraphLaunch", base + 420, corr + 9)]
        events += [gpu(f"verify{j}", base + 450 + 30 * j, 20, corr + 9) for j in range(5)]
    return events


def test_speculative_trace_counts_verify_steps(tmp_path):
    s = summarize_trace(write_trace(tmp_path / "spec.json", noise() + speculative_events(3)))
    assert (s.scope, s.units, s.unit) == (SCOPE_SPECULATIVE, 3, "verify_step")
    assert (s.kernel_launches, s.graph_launches, s.gpu_kernels) == (6, 3, 21)  # draft and verify together
    assert (s.verify_steps, s.verify_graph_launches, s.verify_kernel_launches) == (3, 3, 0)
    assert (s.verify_us, s.draft_us, s.prefills) == (900, 600, 1)
    assert s.tokens is None and s.to_dict()["kernel_launches_per_verify_step"] == 2.0
    text = format_summary(s)
    assert "3 verify steps" in text and "verify steps: 3, 300 µs wall each, 1.00 graph and 0.0 kernel launches" in text
    assert short_summary(s).splitlines()[0].startswith("speculative decode: 3 verify steps, 2.0 kernel launches/")


def test_real_cpu_trace_of_a_speculative_run(tmp_path):
    torch = pytest.importorskip("torch")
    from gpt_fast.convert.random_init import random_weights
    from gpt_fast.engine.engine import Engine, EngineOptions
    from gpt_fast.generation.options import SpeculativeOptions
    from gpt_fast.generation.sampling import SamplingConfig
    from gpt_fast.model.shapes import get_shape

    shape = get_shape("tiny")
    options = EngineOptions(device="cpu", speculative=SpeculativeOptions(prompt_lookup=2, k=3))
    engine = Engine.from_state(shape, random_weights(shape, torch.float32, seed=0), options)
    with engine.profiled(tmp_path / "spec.json"):
        result = engine.generate_ids([1, 2, 3, 1, 2, 3], 12, SamplingConfig(temperature=0))
    s = summarize_trace(tmp_path / "spec.json")
    rounds = result.speculative.rounds
    assert (s.scope, s.verify_steps, s.units) == (SCOPE_SPECULATIVE, rounds, rounds) and rounds > 1
    assert s.prefills == 1 and s.verify_us > 0 and s.draft_us > 0


def complete_events(path: Path) -> list[dict[str, Any]]:
    """The reference reading of a small trace: json.load, nothing skipped but non-"X" events."""
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def test_real_cpu_trace_with_profiler_steps(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, schedule

    x = torch.randn(16, 16)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3, repeat=1)) as prof:
        for _ in range(6):
            x = torch.tanh(x @ x)
            prof.step()
    path = tmp_path / "steps.json"
    prof.export_chrome_trace(str(path))
    steps = [e for e in complete_events(path) if e["name"].startswith("ProfilerStep#")]
    s = summarize_trace(path)
    assert (s.scope, s.units) == (SCOPE_STEPS, len(steps)) and len(steps) == 3  # the active steps
    assert s.wall_us == pytest.approx(max(e["ts"] + e["dur"] for e in steps) - min(e["ts"] for e in steps))
    assert (s.kernel_launches, s.graph_launches, s.gpu_kernels, s.busy_fraction) == (0, 0, 0, None)
    assert s.to_dict()["steps"] == 3 and "3 steps" in format_summary(s)


def test_real_cpu_trace_without_marks(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(16, 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x = torch.tanh(x @ x)
    path = tmp_path / "whole.json"
    prof.export_chrome_trace(str(path))
    events = complete_events(path)
    s = summarize_trace(path)
    assert (s.scope, s.units, s.tokens, s.kernel_launches, s.gpu_kernels) == (SCOPE_WHOLE, 1, None, 0, 0)
    assert s.wall_us == pytest.approx(max(e["ts"] + e.get("dur", 0) for e in events) - min(e["ts"] for e in events))
    assert "scope: whole trace" in format_summary(s)


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
    [
        b'{"traceEvents": [{"ph": "X", "name": ',
        b"",
        b'{"traceEvents": [\xff]}',
        b'{"traceEvents": []} trailing',
        b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1e999}]}',
        b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 123456789012345678901234567890}]}',
        b'{"traceEvents": [{"ph": "X", "name": "a", "ts": NaN}]}',
    ],
    ids=["truncated", "empty", "bad-bytes", "trailing", "float-overflow", "int-overflow", "nan"],
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
    assert_one_line_error(excinfo, path, DECODE_MARK, VERIFY_MARK, "gpt-fast generate --profile")


def gzip_of(*parts: tuple[bytes, int]) -> bytes:
    """gzip of each (bytes, n) part repeated n times, compressed piece by piece: the inflated whole is never held."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: gzip framing
    out = []
    for piece, times in parts:
        block, blocks = (piece * 65_536, times // 65_536) if times >= 65_536 else (piece * times, 1)
        out += [packer.compress(block) for _ in range(blocks)]
    return b"".join([*out, packer.flush()])


def peak_bytes(path: Path) -> tuple[str, int]:
    """The one-line ValueError that summarize_trace raises on ``path``, and the memory it took to get there."""
    summarize_trace(write_trace(path.with_name("warm.json"), eager_events(1, CUDA_EAGER)))  # numpy's lazy imports
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as excinfo:
            summarize_trace(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_one_line_error(excinfo, path)
    return str(excinfo.value), peak


def test_gzip_bomb_stops_at_the_size_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_summary, "MAX_JSON_BYTES", 1 << 18)
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip_of((b'{"traceEvents": [', 1), (b'{"ph": "i"},', 1 << 20), (b"{}]}", 1)))
    assert path.stat().st_size < 64 << 10  # 12 MiB of JSON inflated
    message, peak = peak_bytes(path)
    assert "more than 262144 bytes of JSON (a gzip bomb?)" in message and peak < 2 << 20


@pytest.mark.parametrize(
    ("head", "filler", "tail"),
    [
        (b'{"traceEvents": [', b" ", b"]}"),
        (b'{"traceEvents": [{"ph": "X", "name": "', b"a", b'"}]}'),
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1', b"0", b"}]}"),
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "args": [0', b",0", b"]}]}"),
        (b'{"deviceProperties": [0', b",0", b'], "traceEvents": []}'),
    ],
    ids=["spaces", "long-string", "long-number", "long-array", "outside-events"],
)
def test_bytes_without_a_complete_event_are_bounded(tmp_path, monkeypatch, head, filler, tail):
    monkeypatch.setattr(trace_summary, "MAX_EVENT_BYTES", 1 << 18)
    path = tmp_path / "filler.json.gz"
    path.write_bytes(gzip_of((head, 1), (filler, 32 << 20), (tail, 1)))
    message, peak = peak_bytes(path)
    assert "more than 262144 bytes of JSON without a complete trace event" in message
    assert peak < 4 << 20  # an eighth of the JSON at least


@pytest.mark.parametrize(
    ("head", "tail"),
    [
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "args": ', b"}]}"),
        (b'{"traceEvents": [', b"]}"),
        (b'{"other": ', b', "traceEvents": []}'),
        (b"", b""),
    ],
    ids=["in-args", "event", "outside-events", "top"],
)
@pytest.mark.parametrize("opening", [b"[", b'{"a": '])
def test_deep_nesting_is_refused_in_flat_memory(tmp_path, head, tail, opening):
    levels = 40_000
    path = tmp_path / "deep.json"
    path.write_bytes(head + opening * levels + b"1" + (b"]" if opening == b"[" else b"}") * levels + tail)
    message, peak = peak_bytes(path)
    assert f"JSON nested deeper than {trace_summary.MAX_DEPTH} levels" in message and peak < 4 << 20


def nesting(value: Any) -> int:
    """Reference depth of a JSON value: 1 per array or object around the deepest leaf."""
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    return 0


# Strings that a bracket counter unaware of strings and escapes gets wrong: brackets, escaped quotes, escaped
# backslashes before a closing quote, UTF-8.
TRICKY = ["[[[{{", "]]}}}", 'q"[', "b\\", 'c\\\\"{', '\\"\\\\[', "é[ü{", "\\" * 7 + '"['] * 3


@pytest.mark.parametrize("read_bytes", [1, 2, 3, 5, 7, 1 << 16])
def test_depth_count_matches_json_at_every_read_size(tmp_path, monkeypatch, read_bytes):
    args: Any = {"tricky": TRICKY}
    for name in TRICKY:
        args = {name: [args, name]}
    doc = {"traceEvents": [{"ph": "X", "name": name, "ts": 1, "args": args} for name in TRICKY]}
    path = tmp_path / "tricky.json"
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    depth = nesting(doc)
    monkeypatch.setattr(trace_summary, "READ_BYTES", read_bytes)
    monkeypatch.setattr(trace_summary, "MAX_DEPTH", depth)
    assert summarize_trace(path).scope == SCOPE_WHOLE
    monkeypatch.setattr(trace_summary, "MAX_DEPTH", depth - 1)
    with pytest.raises(ValueError) as excinfo:
        summarize_trace(path)
    assert_one_line_error(excinfo, path, f"deeper than {depth - 1} levels")


def test_events_of_the_wrong_shape_are_ignored(tmp_path):
    events = [
        *(1, "x", None, [], [1, 2], {"ph": 5}, {"ph": "X"}),
        {"ph": "X", "name": 5, "ts": 1},
        {"ph": "X", "name": "cudaLaunchKernel", "ts": "7"},
        {"ph": "X", "name": "cudaLaunchKernel", "ts": True},
        {"ph": "X", "name": "cudaLaunchKernel", "ts": 1, "pid": [1], "args": []},  # counts
        {"ph": "X", "name": "cudaLaunchKernel", "ts": 2, "pid": {"a": 1}, "args": {"correlation": "5"}},  # counts
        {"ph": "X", "cat": ["kernel"], "name": "k0", "ts": 3},
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 4, "dur": "5", "args": {"correlation": 1e300}},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 5, "dur": -3, "args": {"correlation": -4}},
        {"ph": "X", "cat": "kernel", "name": "k3", "ts": 6, "dur": 2.0, "args": {"correlation": 2.0}},
        {"ph": "X", "name": "ProfilerStep#", "ts": 0, "dur": 100},
        {"ph": "X", "name": "ProfilerStep#1a", "ts": 0, "dur": 100},
        {"ph": "X", "name": "ProfilerStep#2", "ts": 0, "dur": 100, "pid": 0, "cat": "gpu_user_annotation"},
    ]
    s = summarize_trace(write_trace(tmp_path / "odd.json", events))
    assert (s.scope, s.kernel_launches, s.gpu_kernels, s.kernel_time_us, s.wall_us) == (SCOPE_WHOLE, 2, 3, 2.0, 100)
    assert s.top_kernels == (("k3", 1, 2.0), ("k1", 1, 0.0), ("k2", 1, 0.0))


@pytest.mark.parametrize(
    "doc",
    [{"traceEvents": {"ph": "X"}}, {"traceEvents": "events"}, {"traceEvents": [{"ph": "M", "name": "process_name"}]}],
    ids=["object", "string", "metadata-only"],
)
def test_traces_without_complete_events(tmp_path, doc):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as excinfo:
        summarize_trace(path)
    assert_one_line_error(excinfo, path, "trace")


def test_cli_error_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": [' + b"[" * 40_000))
    with pytest.raises(SystemExit) as exit_info:
        main(["trace-summary", str(path)])
    out, err = capsys.readouterr()
    assert exit_info.value.code != 0 and out == ""
    assert err.splitlines() == [f"error: {path}: JSON nested deeper than {trace_summary.MAX_DEPTH} levels"]


COLLECTIVE_NAMES = [
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclWorkElem)",
    "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)",
    "void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 8>(c10::BFloat16**, unsigned long)",
]


@pytest.mark.parametrize("name", COLLECTIVE_NAMES, ids=["nccl", "nccl-old", "rccl", "symm-mem"])
def test_collective_kernels_are_counted_apart(tmp_path, name):
    events = noise()
    for i in range(4):  # per token: one graph launch, a GEMV and two all-reduces (the second one after the GEMV)
        base, corr = 1000 * i, 500 + i
        events += [mark(DECODE_MARK, base + 100, 500), call("cudaGraphLaunch", base + 120, corr)]
        events += [gpu("triton_poi_fused_all_reduce_0", base + 200, 10, corr), gpu(name, base + 210, 12, corr)]
        events += [gpu("gemv", base + 230, 30, corr), gpu(name, base + 260, 8, corr)]
    s = summarize_trace(write_trace(tmp_path / "tp.json", events))
    assert (s.collective_kernels, s.collective_time_us) == (8, pytest.approx(80.0))
    assert s.kernel_time_us == pytest.approx(240.0)  # a copy kernel inductor names after the op is not one
    assert "collectives per token: 2.0 kernels (8 kernels in total), 20 µs/token (33.3% of kernel time)" in (
        format_summary(s)
    )


def test_a_trace_without_collectives_says_nothing_of_them(tmp_path):
    s = summarize_trace(write_trace(tmp_path / "eager.json", noise() + eager_events(4, CUDA_EAGER)))
    assert s.collective_kernels == 0 and "collectives" not in format_summary(s)


def op(name: str, ts: float, dur: float, tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur}


def test_a_cpu_trace_shows_the_operators_by_self_time(tmp_path):
    """Self time: an operator's time less that of the operators directly inside it, on its own thread."""
    events = [
        mark(DECODE_MARK, 0, 100),
        op("aten::linear", 0, 100),
        op("aten::matmul", 10, 30),
        op("aten::mm", 15, 10),
        op("aten::add", 50, 10),
        op("aten::add", 20, 55, tid=2),  # another thread: inside nothing
        op("aten::mul", 500, 40),  # outside the decode mark
    ]
    s = summarize_trace(write_trace(tmp_path / "t.json", events))
    assert s.top_cpu_ops == (
        ("aten::add", 2, 65.0),
        ("aten::linear", 1, 60.0),
        ("aten::matmul", 1, 20.0),
        ("aten::mm", 1, 10.0),
    )
    assert s.cpu_op_time_us == 155.0
    text = format_summary(s)
    assert "no kernels in decode (a CPU trace)" in text and "top operators by CPU self time (4):" in text
    assert " 41.9%      65 µs x2       aten::add" in text
    assert short_summary(s).splitlines()[1] == (
        "CPU trace: top operators by self time in decode: aten::add 42%, aten::linear 39%, aten::matmul 13%"
    )


def test_cpu_self_times_match_the_profilers_own(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.nn.functional.linear(torch.relu(x @ x), x).sum()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    s = summarize_trace(tmp_path / "t.json", top=50)
    ours = {name: total for name, _, total in s.top_cpu_ops}
    theirs = {e.key: e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::")}
    for name in ("aten::mm", "aten::relu", "aten::sum", "aten::linear", "aten::matmul"):
        assert ours[name] == pytest.approx(theirs[name], rel=0.05, abs=3), name
