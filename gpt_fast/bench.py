"""`gpt-fast bench`: the blog's compile-mode experiment in one command.

Each mode runs `gpt-fast generate` in a fresh process (no compile state shared between modes) and reports through
``--metrics_json``; this process measures the device's copy bandwidth once, then tabulates, charts and, with
``--profile``, summarizes each mode's trace.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gpt_fast.device import device_name
from gpt_fast.fileio import atomic_path, write_text_atomic
from gpt_fast.generate import COMPILE_MODES

COPY_BYTES_GPU = 4 << 30  # a copy this large is far beyond any cache
COPY_BYTES_CPU = 256 << 20
COPY_REPEATS = 10


@dataclass(frozen=True)
class ModeResult:
    mode: str
    ok: bool
    error: str | None = None
    compile_seconds: float | None = None
    tokens_per_sec_median: float | None = None
    tokens_per_sec_min: float | None = None
    tokens_per_sec_max: float | None = None
    ttft_ms_median: float | None = None
    bandwidth_gbps: float | None = None  # weight bytes per token x median tokens/sec
    copy_fraction: float | None = None  # of the measured copy bandwidth
    memory_gb: float | None = None
    samples: int = 0
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


def mode_result(mode: str, metrics: dict, copy_gbps: float, trace: dict | None, log: str) -> ModeResult:
    steady = [s for s in metrics["samples"] if not s["warmup"]] or metrics["samples"]
    rates = [s["tokens_per_sec"] for s in steady]
    median_rate = statistics.median(rates)
    bandwidth = metrics["weight_bytes_per_token"] * median_rate / 1e9
    return ModeResult(
        mode=mode,
        ok=True,
        compile_seconds=metrics["compile_seconds"],
        tokens_per_sec_median=median_rate,
        tokens_per_sec_min=min(rates),
        tokens_per_sec_max=max(rates),
        ttft_ms_median=1e3 * statistics.median(s["ttft_seconds"] for s in steady),
        bandwidth_gbps=bandwidth,
        copy_fraction=bandwidth / copy_gbps,
        memory_gb=metrics["memory_gb"],
        samples=len(rates),
        trace=trace,
        log=log,
    )


def run_mode(
    mode: str, generate_args: Sequence[str], out_dir: Path, copy_gbps: float, profile_dir: Path | None
) -> ModeResult:
    """`gpt-fast generate --compile MODE` in a fresh Python process; its output goes to a log file."""
    metrics_path = out_dir / f"metrics_{mode}.json"
    log_path = out_dir / f"log_{mode}.txt"
    command = [
        sys.executable,
        "-m",
        "gpt_fast",
        "generate",
        *generate_args,
        "--compile",
        mode,
        "--metrics_json",
        str(metrics_path),
        "--no_stream",
    ]
    trace_prefix = profile_dir / f"trace_compile_{mode.replace('-', '')}" if profile_dir is not None else None
    if trace_prefix is not None:
        command += ["--profile", str(trace_prefix)]
    with log_path.open("w") as log:
        returncode = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        ).returncode
    if returncode != 0 or not metrics_path.is_file():
        lines = log_path.read_text(errors="replace").strip().splitlines()
        return ModeResult(mode=mode, ok=False, error=(lines or ["no output"])[-1], log=str(log_path))
    trace = None
    if trace_prefix is not None:
        from gpt_fast.trace_summary import summarize_trace

        trace = summarize_trace(Path(f"{trace_prefix}.json")).to_dict()
    return mode_result(mode, json.loads(metrics_path.read_text()), copy_gbps, trace, str(log_path))


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown_table(report: BenchReport) -> str:
    """One row per mode; trace columns appear when the modes were profiled."""
    traced = any(r.trace for r in report.results)
    header = [
        "mode",
        "compile (s)",
        "tok/s median",
        "tok/s min–max",
        "TTFT (ms)",
        "GB/s",
        "% of copy BW",
        "memory (GB)",
    ]
    if traced:
        header += ["kernel launches/token", "graph launches/token", "GPU kernels/token", "GPU busy"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in report.results:
        if not r.ok:
            rows.append(f"| {r.mode} | failed: {r.error} |" + " |" * (len(header) - 2))
            continue
        cells = [
            r.mode,
            _fmt(r.compile_seconds, ".1f"),
            _fmt(r.tokens_per_sec_median, ".1f"),
            f"{r.tokens_per_sec_min:.1f}–{r.tokens_per_sec_max:.1f}",
            _fmt(r.ttft_ms_median, ".1f"),
            _fmt(r.bandwidth_gbps, ".0f"),
            _fmt(None if r.copy_fraction is None else 100 * r.copy_fraction, ".1f"),
            _fmt(r.memory_gb, ".2f"),
        ]
        if traced:
            t = r.trace or {}
            busy = t.get("busy_fraction")
            cells += [
                _fmt(t.get("kernel_launches_per_token"), ".1f"),
                _fmt(t.get("graph_launches_per_token"), ".2f"),
                _fmt(t.get("gpu_kernels_per_token"), ".1f"),
                "—" if busy is None else f"{100 * busy:.1f}%",
            ]
        rows.append("| " + " | ".join(cells) + " |")
    head = (
        f"{report.device_name} ({report.device}), torch {report.torch_version}, {report.date}; copy bandwidth "
        f"{report.copy_bandwidth_gbps:.0f} GB/s "
        f"(read + write); weights read per token {report.weight_bytes_per_token / 1e9:.3f} GB\n\n"
        if report.weight_bytes_per_token
        else ""
    )
    return head + "\n".join(rows) + "\n"


def write_csv(path: Path, report: BenchReport) -> None:
    names = [f for f in ModeResult.__dataclass_fields__ if f not in ("trace", "log")]
    with atomic_path(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for r in report.results:
            writer.writerow({k: v for k, v in asdict(r).items() if k in names})


def write_chart(path: Path, report: BenchReport, title: str) -> bool:
    """A bar chart of tokens/sec per mode, like the blog's; False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in report.results if r.ok]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar([r.mode for r in done], [r.tokens_per_sec_median for r in done], color="#4878d0")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_xlabel("mode")
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
    generate_args: Sequence[str],
    out_dir: Path,
    device: torch.device,
    *,
    profile_dir: Path | None,
    title: str,
    command: str,
    progress: Callable[[str], None],
) -> BenchReport:
    """Run each mode, then write bench.json, bench.csv, bench.md and (with matplotlib) bench.png into ``out_dir``."""
    unknown = [m for m in modes if m not in COMPILE_MODES]
    if unknown or not modes:
        raise ValueError(f"--modes: {', '.join(unknown) or 'none given'}; choose from {', '.join(COMPILE_MODES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
    progress(f"Measuring copy bandwidth on {device} ...")
    copy_gbps = copy_bandwidth_gbps(device)
    results = []
    for i, mode in enumerate(modes, 1):
        progress(f"[{i}/{len(modes)}] {mode}: running in a fresh process (log: {out_dir / f'log_{mode}.txt'}) ...")
        start = time.perf_counter()
        result = run_mode(
            mode,
            ["--checkpoint_path", str(checkpoint), "--device", str(device), *generate_args],
            out_dir,
            copy_gbps,
            profile_dir,
        )
        results.append(result)
        status = f"{result.tokens_per_sec_median:.1f} tok/s" if result.ok else f"failed: {result.error}"
        progress(f"[{i}/{len(modes)}] {mode}: {status} ({time.perf_counter() - start:.0f} s)")
    first = next((json.loads((out_dir / f"metrics_{r.mode}.json").read_text()) for r in results if r.ok), None)
    report = BenchReport(
        checkpoint=str(checkpoint),
        device=str(device),
        device_name=device_name(device),
        torch_version=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        command=command,
        copy_bandwidth_gbps=copy_gbps,
        weight_bytes_per_token=first["weight_bytes_per_token"] if first else None,
        results=results,
    )
    write_text_atomic(out_dir / "bench.json", json.dumps(asdict(report), indent=2) + "\n")
    write_csv(out_dir / "bench.csv", report)
    write_text_atomic(out_dir / "bench.md", markdown_table(report))
    if write_chart(out_dir / "bench.png", report, title):
        progress(f"Chart: {out_dir / 'bench.png'}")
    return report
