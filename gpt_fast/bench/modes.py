"""`gpt-fast bench modes` (also `gpt-fast bench` without a subcommand): the blog's compile-mode experiment in one
command.

Each mode runs the `generate` command in a fresh process (no compile state shared between modes), handed its
options as typed objects and handing back its :class:`RunMetrics`; every mode compiles with a compile cache of its
own, empty (cold) unless ``--warm_cache`` fills it first with a priming run. This process measures the device's
copy bandwidth once, then tabulates and charts.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.decode import COMPILE_MODES
from gpt_fast.generation.metrics import RunMetrics
from gpt_fast.jobs.generate import run_generate
from gpt_fast.jobs.options import GenerateOptions
from gpt_fast.util.device import device_name
from gpt_fast.util.fileio import atomic_path, first_line, trace_file, write_text_atomic
from gpt_fast.util.settings import apply_torch_settings

COPY_BYTES_GPU = 4 << 30  # a copy this large is far beyond any cache
COPY_BYTES_CPU = 256 << 20
COPY_REPEATS = 10
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")  # where inductor and Triton keep compiled code


@dataclass(frozen=True)
class ModeResult:
    mode: str
    ok: bool
    error: str | None = None
    compile_cache: str | None = None  # cold, warm or partly warm (None for mode none, which compiles nothing)
    compile_seconds: float | None = None
    tokens_per_sec_median: float | None = None
    tokens_per_sec_min: float | None = None
    tokens_per_sec_max: float | None = None
    warmup_only: bool = False  # the figures are the warm-up's (one sample): they include compilation
    ttft_ms_median: float | None = None
    bandwidth_gbps: float | None = None  # weight bytes per token x median tokens/sec
    copy_fraction: float | None = None  # of the measured copy bandwidth
    memory_gb: float | None = None
    samples: int = 0
    weight_bytes_per_token: int | None = None
    profiled_tokens_per_sec: float | None = None  # the profiled sample, reported apart, never in the figures above
    acceptance_rate: float | None = None  # speculative decoding, over the timed samples
    tokens_per_step: float | None = None  # new tokens per verify step
    draft_ms_per_step: float | None = None
    verify_ms_per_step: float | None = None
    trace: dict | None = None  # trace-summary figures, when profiled
    log: str | None = None


@dataclass(frozen=True)
class BenchReport:
    checkpoint: str
    device: str
    device_name: str
    torch_version: str
    date: str
    command: str
    copy_bandwidth_gbps: float
    weight_bytes_per_token: int | None
    results: list[ModeResult] = field(default_factory=list)


@dataclass(frozen=True)
class ChildRun:
    """One `generate` run in a fresh process: what it runs, where its output and compile cache go."""

    checkpoint: Path
    engine: EngineOptions
    generate: GenerateOptions
    log: Path
    compile_cache: Path


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (median of several copies)."""
    nbytes = COPY_BYTES_GPU if device.type == "cuda" else COPY_BYTES_CPU
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(COPY_REPEATS):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9


def _child_main(run: ChildRun, results: Connection) -> None:
    """The spawned process: its output goes to the log (file descriptors too, for what compilers print), its
    compile cache is its own; it sends back ``("ok", RunMetrics)`` or ``("error", one line)``."""
    with run.log.open("w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    for name in CACHE_ENV:
        os.environ[name] = str(run.compile_cache / name.lower())
    try:
        engine = Engine.open(run.checkpoint, run.engine)
        apply_torch_settings(engine.device, compiled=run.engine.compile != "none", threads=run.engine.threads)
        metrics = run_generate(engine, run.generate, write=lambda text: print(text, end="", flush=True))
    except Exception as err:
        print(f"error: {first_line(err)}", flush=True)
        results.send(("error", first_line(err)))
        raise
    results.send(("ok", metrics))


def run_child(run: ChildRun) -> RunMetrics | str:
    """:class:`RunMetrics` of the run, or the line that says why it failed."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child_main, args=(run, sender))
    process.start()
    sender.close()
    try:
        status, payload = receiver.recv()
    except EOFError:
        status, payload = "error", None
    process.join()
    if status == "ok" and process.exitcode == 0:
        return payload
    return payload or f"the process ended with exit code {process.exitcode} (see {run.log})"


def mode_result(mode: str, metrics: RunMetrics, copy_gbps: float, cache: str | None, log: Path) -> ModeResult:
    timed = metrics.timed
    rates = [s.tokens_per_sec for s in timed]
    median_rate = statistics.median(rates)
    bandwidth = metrics.weight_bytes_per_token * median_rate / 1e9
    profiled = [s.tokens_per_sec for s in metrics.samples if s.profiled]
    spec = metrics.speculative
    names = ("acceptance_rate", "tokens_per_step", "draft_ms_per_step", "verify_ms_per_step")
    speculative = {name: getattr(spec, name) for name in names} if spec is not None else {}
    return ModeResult(
        mode=mode,
        ok=True,
        compile_cache=metrics.compile_cache,  # as measured in the run: the priming took, or the cache was empty
        compile_seconds=metrics.compile_seconds,
        tokens_per_sec_median=median_rate,
        tokens_per_sec_min=min(rates),
        tokens_per_sec_max=max(rates),
        warmup_only=all(s.warmup for s in timed),
        ttft_ms_median=1e3 * statistics.median(s.ttft_seconds for s in timed),
        bandwidth_gbps=bandwidth,
        copy_fraction=bandwidth / copy_gbps,
        memory_gb=metrics.memory_gb,
        samples=len(rates),
        weight_bytes_per_token=metrics.weight_bytes_per_token,
        profiled_tokens_per_sec=profiled[0] if profiled else None,
        trace=metrics.trace,
        log=str(log),
        **speculative,
    )


def run_mode(
    checkpoint: Path,
    mode: str,
    engine: EngineOptions,
    generate: GenerateOptions,
    out_dir: Path,
    *,
    copy_gbps: float,
    warm_cache: bool,
) -> ModeResult:
    """One mode in a fresh process with a compile cache of its own: empty, or filled first by a priming run."""
    log = out_dir / f"log_{mode}.txt"
    cache = None if mode == "none" else "warm" if warm_cache else "cold"
    with tempfile.TemporaryDirectory(prefix="gpt-fast-compile-cache-") as cache_dir:
        engine = dataclasses.replace(engine, compile=mode)
        if cache == "warm":
            priming = dataclasses.replace(generate, num_samples=1, profile=None, metrics_json=None)
            primed = run_child(
                ChildRun(checkpoint, engine, priming, out_dir / f"log_{mode}_priming.txt", Path(cache_dir))
            )
            if isinstance(primed, str):
                return ModeResult(mode=mode, ok=False, error=f"priming run: {primed}", log=str(log))
        outcome = run_child(ChildRun(checkpoint, engine, generate, log, Path(cache_dir)))
    if isinstance(outcome, str):
        return ModeResult(mode=mode, ok=False, error=outcome, compile_cache=cache, log=str(log))
    return mode_result(mode, outcome, copy_gbps, cache, log)


def parse_modes(text: str) -> list[str]:
    """``--modes``: comma-separated compile modes, each known."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in COMPILE_MODES]
    if unknown or not modes:
        raise ValueError(f"--modes: {', '.join(unknown) or 'none given'}; choose from {', '.join(COMPILE_MODES)}")
    return modes


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown_table(report: BenchReport) -> str:
    """One row per mode; speculative-decoding columns appear when it was on, trace columns when the modes were
    profiled."""
    traced = any(r.trace for r in report.results)
    speculative = any(r.acceptance_rate is not None for r in report.results)
    header = ["mode", "compile cache", "compile (s)", "tok/s median", "tok/s min–max", "TTFT (ms)", "GB/s"]
    header += ["% of copy BW", "memory (GB)"]
    if speculative:
        header += ["acceptance", "tokens/verify step", "draft ms/step", "verify ms/step"]
    if traced:
        header += ["profiled tok/s", "kernel launches/token", "graph launches/token", "GPU kernels/token", "GPU busy"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in report.results:
        if not r.ok:
            rows.append(f"| {r.mode} | failed: {r.error} |" + " |" * (len(header) - 2))
            continue
        rows.append("| " + " | ".join(_cells(r, traced, speculative)) + " |")
    head = ""
    if report.weight_bytes_per_token:
        head = (
            f"{report.device_name} ({report.device}), torch {report.torch_version}, {report.date}; copy bandwidth "
            f"{report.copy_bandwidth_gbps:.0f} GB/s (read + write); weights read per token "
            f"{report.weight_bytes_per_token / 1e9:.3f} GB\n\n"
        )
    notes = (
        "\n\nwarm-up only: the figures are those of the one sample, compilation included."
        if any(r.warmup_only for r in report.results)
        else ""
    )
    return head + "\n".join(rows) + notes + "\n"


def _cells(r: ModeResult, traced: bool, speculative: bool) -> list[str]:
    rate = _fmt(r.tokens_per_sec_median, ".1f") + (" (warm-up only)" if r.warmup_only else "")
    cells = [r.mode, r.compile_cache or "—", _fmt(r.compile_seconds, ".1f"), rate]
    cells += [f"{r.tokens_per_sec_min:.1f}–{r.tokens_per_sec_max:.1f}", _fmt(r.ttft_ms_median, ".1f")]
    cells += [_fmt(r.bandwidth_gbps, ".0f"), _fmt(None if r.copy_fraction is None else 100 * r.copy_fraction, ".1f")]
    cells += [_fmt(r.memory_gb, ".2f")]
    if speculative:
        acceptance = "—" if r.acceptance_rate is None else f"{r.acceptance_rate:.1%}"
        cells += [acceptance, _fmt(r.tokens_per_step, ".2f")]
        cells += [_fmt(r.draft_ms_per_step, ".2f"), _fmt(r.verify_ms_per_step, ".2f")]
    if traced:
        t: dict[str, Any] = r.trace or {}
        busy = t.get("busy_fraction")
        cells += [_fmt(r.profiled_tokens_per_sec, ".1f"), _fmt(t.get("kernel_launches_per_token"), ".1f")]
        cells += [_fmt(t.get("graph_launches_per_token"), ".2f"), _fmt(t.get("gpu_kernels_per_token"), ".1f")]
        cells += ["—" if busy is None else f"{100 * busy:.1f}%"]
    return cells


def write_csv(path: Path, report: BenchReport) -> None:
    names = [f for f in ModeResult.__dataclass_fields__ if f not in ("trace", "log")]
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in report.results:
            writer.writerow({k: v for k, v in asdict(r).items() if k in names})


def write_chart(path: Path, report: BenchReport, title: str) -> bool:
    """A bar chart of tokens/sec per mode, like the blog's, with the min–max spread of the timed samples as error
    bars; False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in report.results if r.ok]
    medians = [r.tokens_per_sec_median for r in done]
    spread = [
        [m - r.tokens_per_sec_min for m, r in zip(medians, done, strict=True)],
        [r.tokens_per_sec_max - m for m, r in zip(medians, done, strict=True)],
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r.mode}\n({r.compile_cache} cache)" if r.compile_cache else r.mode for r in done]
    bars = ax.bar(labels, medians, yerr=spread, capsize=6, color="#4878d0")
    ax.bar_label(
        bars, labels=[f"{m:.1f}" + (" (warm-up)" if r.warmup_only else "") for m, r in zip(medians, done, strict=True)]
    )
    ax.set_xlabel("mode (bars: median, whiskers: min–max of the timed samples)")
    ax.set_ylabel("Inference throughput (tokens/sec)")
    ax.set_title(f"{title}\n{report.device_name}, torch {report.torch_version}", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return True


def run_bench(
    checkpoint: Path,
    modes: Sequence[str],
    engine: EngineOptions,
    generate: GenerateOptions,
    out_dir: Path,
    *,
    warm_cache: bool,
    title: str,
    command: str,
    progress: Callable[[str], None],
) -> BenchReport:
    """Run each mode, then write bench.json, bench.csv, bench.md and (with matplotlib) bench.png into ``out_dir``.
    ``generate.profile``, when set, is a folder or file prefix: each mode's trace is named after the mode."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = Engine.open(checkpoint, engine).device
    progress(f"Measuring copy bandwidth on {device} ...")
    copy_gbps = copy_bandwidth_gbps(device)
    results = []
    for i, mode in enumerate(modes, 1):
        progress(f"[{i}/{len(modes)}] {mode}: running in a fresh process (log: {out_dir / f'log_{mode}.txt'}) ...")
        start = time.perf_counter()
        mode_options = dataclasses.replace(generate, metrics_json=out_dir / f"metrics_{mode}.json")
        if generate.profile is not None:
            trace = trace_file(generate.profile, name=f"trace_compile_{mode.replace('-', '')}", variant=mode)
            mode_options = dataclasses.replace(mode_options, profile=str(trace))
        result = run_mode(checkpoint, mode, engine, mode_options, out_dir, copy_gbps=copy_gbps, warm_cache=warm_cache)
        results.append(result)
        status = f"{result.tokens_per_sec_median:.1f} tok/s" if result.ok else f"failed: {result.error}"
        progress(f"[{i}/{len(modes)}] {mode}: {status} ({time.perf_counter() - start:.0f} s)")
    report = BenchReport(
        checkpoint=str(checkpoint),
        device=str(device),
        device_name=device_name(device),
        torch_version=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        command=command,
        copy_bandwidth_gbps=copy_gbps,
        weight_bytes_per_token=next((r.weight_bytes_per_token for r in results if r.ok), None),
        results=results,
    )
    write_text_atomic(out_dir / "bench.json", json.dumps(asdict(report), indent=2) + "\n")
    write_csv(out_dir / "bench.csv", report)
    write_text_atomic(out_dir / "bench.md", markdown_table(report))
    report_chart(out_dir / "bench.png", report, title, progress)
    return report


def report_chart(path: Path, report: BenchReport, title: str, progress: Callable[[str], None]) -> None:
    """Write the chart and say where, or that none was written and why."""
    if write_chart(path, report, title):
        progress(f"Chart: {path}")
    else:
        progress(f"No chart written: {path.name} needs matplotlib (pip install matplotlib)")
