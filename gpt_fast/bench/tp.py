"""Tensor-parallel decode speed over world sizes, in one invocation: for each world size N it starts N ranks with
torchrun (:mod:`gpt_fast.parallel.launch`), each of which makes its own part of a random model of a named shape directly
in its GPU's memory (no checkpoint on disk: a Llama-2-70B shape is 138 GB), decodes as ``gpt-fast generate`` does, and
profiles one more generation on rank 0. Prints one table: tok/s, the speed-up over 1 GPU measured in the same
invocation, weights read per GPU, the share of the summed copy bandwidth of the N GPUs (each measured as
``gpt-fast bench`` does), and the collectives' GPU time per token from the trace (NCCL's kernels; their time includes
waiting for the slowest rank). A world size whose part does not fit a GPU comfortably (its weights over
:data:`FIT_SHARE` of the GPU's memory) is skipped.

    gpt-fast bench tp --shape llama-2-7b --tp 1,2,4
    gpt-fast bench tp --shape llama-2-70b --tp 2,4
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from gpt_fast.accel.options import KernelOptions
from gpt_fast.bench.decode import BLOG_SAMPLING, timed
from gpt_fast.bench.modes import copy_bandwidth_gbps
from gpt_fast.bench.options import TpBenchOptions
from gpt_fast.convert.random_init import INIT_STD
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.jobs.trace_summary import (
    summarize_trace,  # at import: a missing dependency stops the launch, not the ranks
)
from gpt_fast.model.shapes import get_shape
from gpt_fast.parallel.launch import run_ranks
from gpt_fast.parallel.tensor_parallel import Ranks, Shard, check_tensor_parallel, env_ranks
from gpt_fast.util.device import device_name, parse_dtype, resolve_device
from gpt_fast.util.settings import apply_torch_settings

FIT_SHARE = 0.8  # a rank's weights may take at most this share of its GPU's memory
KERNEL_OPTIONS = ("linear", "attention")  # the kernel choices passed on to EngineOptions


@dataclass(frozen=True)
class Result:
    """One world size's figures (rank 0's timings; bytes and bandwidths of every rank)."""

    shape: str
    world_size: int
    skipped: str | None = None  # why it was not run
    tokens_per_sec: float = 0.0  # median of the timed generations
    compile_seconds: float = 0.0  # the first generation's wall time
    bytes_per_token: list[int] | None = None  # weights each rank reads per decoded token
    copy_gbps: list[float] | None = None  # each rank's copy bandwidth
    collective_us_per_token: float | None = None  # rank 0's collective kernels' GPU time per token
    collective_kernels_per_token: float | None = None
    memory_gb: float | None = None  # rank 0's peak allocation
    device_name: str = ""
    torch_version: str = ""


def random_shard(shard: Shard, shape_name: str, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's tensors of a random model (N(0, 0.02²), norms 1), made on ``device``; each rank draws its own."""
    generator = torch.Generator(device=device).manual_seed(shard.rank)
    state = {}
    for name, (size, _) in shard.shard_shapes(get_shape(shape_name), dtype).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(size, dtype=dtype, device=device)
        else:
            state[name] = torch.randn(size, generator=generator, dtype=dtype, device=device).mul_(INIT_STD)
    return state


def part_fits(shard: Shard, shape_name: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why this rank's part does not fit its GPU comfortably, or None."""
    specs = shard.shard_shapes(get_shape(shape_name), dtype)
    needed = sum(torch.Size(size).numel() * kind.itemsize for size, kind in specs.values())
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    if total is not None and needed > FIT_SHARE * total:
        return f"{needed / 1e9:.0f} GB of weights per GPU, more than {FIT_SHARE:.0%} of its {total / 1e9:.0f} GB"
    return None


def measure_rank(args: TpBenchOptions, ranks: Ranks) -> Result | None:
    """This rank's run (every rank takes part in every generation); rank 0 returns the figures."""
    dtype, shard = parse_dtype(args.dtype), Shard(ranks.rank, ranks.world_size)
    device = torch.device(args.device, ranks.local_rank) if args.device == "cuda" else torch.device(args.device)
    reason = part_fits(shard, args.shape, dtype, device)
    if reason is not None:
        return Result(args.shape, ranks.world_size, skipped=reason)
    options = replace(engine_options(args), device=args.device, tp=ranks.world_size)
    engine = Engine.from_state(
        get_shape(args.shape), random_shard(shard, args.shape, dtype, device), options, sharded=True
    )
    gather = engine.parallel.gather if engine.parallel is not None else (lambda value: [value])
    copy = gather(copy_bandwidth_gbps(engine.device))
    prompt = torch.randint(0, engine.model_config.vocab_size, (args.prompt_tokens,), generator=torch.Generator())
    run = lambda: engine.generate_ids(prompt.tolist(), args.new_tokens, BLOG_SAMPLING)  # noqa: E731
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    compile_seconds = timed(run, engine.device)
    rates = [args.new_tokens / timed(run, engine.device) for _ in range(args.repeats)]
    collectives = None
    if args.profile and ranks.rank == 0:
        collectives = profile_collectives(engine, run, Path(args.trace_dir))
    elif args.profile:
        run()  # the profiled generation's partners
    bytes_per_token = gather(engine.weight_bytes_per_token)
    if ranks.rank != 0:
        return None
    return Result(
        shape=args.shape,
        world_size=ranks.world_size,
        tokens_per_sec=statistics.median(rates),
        compile_seconds=compile_seconds,
        bytes_per_token=bytes_per_token,
        copy_gbps=copy,
        collective_us_per_token=collectives[0] if collectives else None,
        collective_kernels_per_token=collectives[1] if collectives else None,
        memory_gb=torch.cuda.max_memory_allocated(engine.device) / 1e9 if engine.device.type == "cuda" else None,
        device_name=device_name(engine.device),
        torch_version=torch.__version__,
    )


def engine_options(args: TpBenchOptions) -> EngineOptions:
    """The engine options of a rank: the compile mode, dtype and kernel choices given (the engine's defaults for
    those not given)."""
    given = {name: getattr(args, f"{name}_kernel") for name in KERNEL_OPTIONS}
    kernels = KernelOptions(**{name: choice for name, choice in given.items() if choice is not None})
    tuning = {"kernel_tuning": args.kernel_tuning} if args.kernel_tuning is not None else {}
    return EngineOptions(compile=args.mode, dtype=args.dtype, kernels=kernels, **tuning)


def kernel_flags(args: TpBenchOptions) -> dict[str, str]:
    """The kernel choices as the flags that hand them on to the ranks: those given, and the engine's defaults."""
    options = engine_options(args)
    flags = {f"{name}_kernel": getattr(options.kernels, name) for name in KERNEL_OPTIONS}
    return flags | {"kernel_tuning": options.kernel_tuning}


def profile_collectives(engine: Engine, run: Callable[[], object], folder: Path) -> tuple[float, float]:
    """One generation recorded by the profiler: its collectives' GPU time (µs) and kernels per decoded token."""
    trace = folder / f"trace_tp{engine.world_size}.json"
    with engine.profiled(trace):
        run()
    summary = summarize_trace(trace)
    return summary.per_unit(summary.collective_time_us), summary.per_unit(summary.collective_kernels)


def worker(args: TpBenchOptions) -> None:
    """One rank (torchrun's environment; a lone process is rank 0 of 1)."""
    ranks = env_ranks() or Ranks(0, 1, 0)
    apply_torch_settings()
    result = measure_rank(args, ranks)
    if result is not None:
        Path(args.result).write_text(json.dumps(asdict(result)))


def run_world_size(args: TpBenchOptions, world_size: int, folder: Path) -> Result:
    """Start ``world_size`` ranks of this module's worker and read rank 0's figures."""
    result = folder / f"result_tp{world_size}.json"
    passed = ["--shape", args.shape, "--mode", args.mode, "--dtype", args.dtype, "--device", args.device]
    passed += ["--prompt_tokens", str(args.prompt_tokens), "--new_tokens", str(args.new_tokens)]
    passed += ["--repeats", str(args.repeats), "--trace_dir", args.trace_dir or str(folder)]
    passed += [] if args.profile else ["--no_profile"]
    passed += [item for name, value in kernel_flags(args).items() for item in (f"--{name}", value)]
    command = ["gpt_fast", "bench", "tp", "--worker", "--result", str(result), *passed]  # `gpt-fast bench tp`
    code = run_ranks(world_size, command, args.timeout)
    if code or not result.is_file():
        return Result(args.shape, world_size, skipped=f"failed (torchrun exit status {code}): see its output above")
    return Result(**json.loads(result.read_text()))


def table(results: Sequence[Result]) -> str:
    """One line per world size; the speed-up is over the 1-GPU line of the same invocation."""
    single = next((r.tokens_per_sec for r in results if r.world_size == 1 and not r.skipped), None)
    lines = [
        "| shape | GPUs | tok/s | × 1 GPU | weights read per GPU (GB) | GB/s per GPU | % of summed copy BW | "
        "collectives per token (µs) | collective kernels per token | compile (s) | memory per GPU (GB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.shape} | {r.world_size} | skipped: {r.skipped} |" + " |" * 8)
            continue
        total_bytes, copy = sum(r.bytes_per_token), sum(r.copy_gbps)
        speedup = f"{r.tokens_per_sec / single:.2f}" if single else "—"
        share = 100 * total_bytes * r.tokens_per_sec / 1e9 / copy
        collective = "—" if r.collective_us_per_token is None else f"{r.collective_us_per_token:.1f}"
        kernels = "—" if r.collective_kernels_per_token is None else f"{r.collective_kernels_per_token:.1f}"
        memory = "—" if r.memory_gb is None else f"{r.memory_gb:.1f}"
        lines.append(
            f"| {r.shape} | {r.world_size} | {r.tokens_per_sec:.1f} | {speedup} | {r.bytes_per_token[0] / 1e9:.2f} | "
            f"{r.bytes_per_token[0] * r.tokens_per_sec / 1e9:.0f} | {share:.1f} | {collective} | {kernels} | "
            f"{r.compile_seconds:.1f} | {memory} |"
        )
    return "\n".join(lines)


def run(args: TpBenchOptions, write: Callable[[str], None] = print) -> list[Result]:
    """The benchmark of ``args`` (`gpt-fast bench tp`): each world size's figures, their table written with
    ``write``; with ``args.worker``, one rank's run (under torchrun), which writes rank 0's figures to a file."""
    args = replace(args, device=args.device or resolve_device(None).type)
    if args.worker:
        worker(args)
        return []
    sizes = args.tp
    engine_options(args)  # refuses a bad choice before any run
    for size in sizes:
        check_tensor_parallel(get_shape(args.shape), None, size)
    if args.trace_dir is not None:
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    available = torch.cuda.device_count() if args.device == "cuda" else max(sizes)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as folder:
        for size in sizes:
            if size > available:
                results.append(Result(args.shape, size, skipped=f"{available} GPU(s) on this host"))
                continue
            results.append(run_world_size(args, size, Path(folder)))
            write(f"measured: {results[-1]}")
    kernels = ", ".join(f"{name} {value}" for name, value in kernel_flags(args).items())
    write(
        f"{args.shape}, {args.device}, torch {torch.__version__}, {args.dtype}, {args.mode}, {kernels}; batch 1, "
        f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new, median of {args.repeats}"
    )
    write(table(results))
    return results


if __name__ == "__main__":  # python -m gpt_fast.bench.tp: `gpt-fast bench tp`
    from gpt_fast.cli.bench import run_alias

    run_alias("tp")
