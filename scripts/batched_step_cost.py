"""The cost of the batcher's decode step by batch size, with the KV cache static (a row of ``--max_seq_length``
positions per slot) and paged (blocks of ``--block_size``, as `gpt-fast serve` runs it), on random weights of a named
shape: the step that `gpt-fast serve` replays, each row at position ``--position``, timed over ``--steps`` steps
after a warm-up, as milliseconds per step and relative to one row's step with the same cache (in the model's dtype,
or ``--kv_cache_dtype``'s). With ``--quantize``,
the random weights are drawn in memory and quantized (int8, or int4 in groups of 128), their products computed by
``--quant_kernel``.

    .venv/bin/python scripts/batched_step_cost.py --shape tiny --device cpu --batches 1,4
    python scripts/batched_step_cost.py --shape llama-2-7b --device cuda --compile reduce-overhead
    python scripts/batched_step_cost.py --shape llama-2-7b --compile reduce-overhead --quantize int8 \
        --quant_kernel gemlite
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from gpt_fast import Engine, EngineOptions
from gpt_fast.accel.options import KernelOptions
from gpt_fast.convert.random_init import random_shape_folder, random_weights
from gpt_fast.generation.slots import SlotState, make_slot_steps
from gpt_fast.model.config import QuantConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.quant.layout import quantize_state
from gpt_fast.util.choices import KV_DTYPE_CHOICES
from gpt_fast.util.device import cudagraph_step_begin, device_synchronize, dtype_name, resolve_device, resolve_dtype


def run_steps(engine: Engine, state: SlotState, decode, rows: int, steps: int) -> None:
    """``steps`` decode steps of ``rows`` rows (each advances their positions by one), then wait for the device."""
    for _ in range(steps):
        cudagraph_step_begin()
        decode(engine.model, state, rows)
    device_synchronize(engine.device)


def step_ms(engine: Engine, state: SlotState, decode, rows: int, steps: int) -> float:
    """Milliseconds per decode step of ``rows`` rows."""
    run_steps(engine, state, decode, rows, 3)  # compile, then record the CUDA graph
    start = time.perf_counter()
    run_steps(engine, state, decode, rows, steps)
    return (time.perf_counter() - start) / steps * 1e3


def print_profile(engine: Engine, state: SlotState, decode, rows: int, steps: int, top: int) -> None:
    """The ``top`` kernels by GPU time over ``steps`` steps, per step (torch.profiler's table)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        run_steps(engine, state, decode, rows, steps)
    sort = "self_device_time_total" if engine.device.type == "cuda" else "self_cpu_time_total"
    print(profile.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=60), flush=True)


def open_engine(args: argparse.Namespace) -> Engine:
    """The engine over the random checkpoint of ``--shape``, or over random weights quantized in memory."""
    device = resolve_device(args.device)
    kernels = KernelOptions(quant=args.quant_kernel)
    options = EngineOptions(
        compile=args.compile, device=args.device, kernels=kernels, kv_cache_dtype=args.kv_cache_dtype
    )
    if args.quantize is None:
        engine = Engine.open(random_shape_folder(args.shape, args.output_dir, device), options)
        engine.load_weights()
        return engine
    shape, dtype = get_shape(args.shape), resolve_dtype("auto", device)
    quant = QuantConfig(args.quantize, 128 if args.quantize == "int4" else None)
    state = quantize_state(random_weights(shape, dtype, seed=0, device=device), shape, quant, dtype, device)
    return Engine.from_state(shape, state, options, quant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--device", default=None)
    parser.add_argument("--compile", default="none")
    parser.add_argument("--kernel_tuning", default="coordinate-descent")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--caches", default="static,paged")
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--position", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--output_dir", type=Path, default=Path("checkpoints/random"))
    parser.add_argument("--profile", type=int, default=0, help="Also print this many kernels by time, per step.")
    parser.add_argument("--quantize", choices=("int8", "int4"), default=None)
    parser.add_argument("--quant_kernel", default="auto")
    parser.add_argument("--kv_cache_dtype", choices=KV_DTYPE_CHOICES, default="auto")
    args = parser.parse_args()
    engine = open_engine(args)
    batches = [int(b) for b in args.batches.split(",")]
    slots, length, size = max(batches), args.max_seq_length, args.block_size
    width = -(-length // size)
    described = f"compile={args.compile} ({args.kernel_tuning}), torch {torch.__version__}"
    if args.quantize:
        described += f", {args.quantize} ({engine.kernels.quant} products)"
    kv_dtype = dtype_name(engine.kv_dtype)
    print(f"{args.shape} on {engine.device_name}, {engine.dtype_name} ({kv_dtype} KV cache), {described}")
    print(f"{slots} slots of {length} positions, each row from position {args.position}, {args.steps} steps timed")
    costs: dict[str, dict[int, float]] = {layout: {} for layout in args.caches.split(",")}
    for layout in costs:
        model = engine.model
        model.setup_caches(1, 2)  # the previous layout's buffers go first
        blocks = {"blocks": slots * width + 1, "block_size": size} if layout == "paged" else {}
        model.setup_caches(slots, length, **blocks)
        if layout == "paged":  # each row its own blocks, in no particular order
            table = torch.randperm(slots * width)[: slots * width].view(slots, width) + 1
            model.block_table.blocks.copy_(table)
        state = SlotState(slots, model.config.vocab_size, engine.device)
        state.input_pos.fill_(args.position)
        state.live.fill_(True)  # every row decodes a sequence
        decode = make_slot_steps(args.compile, tuning=args.kernel_tuning).decode
        with torch.no_grad():
            for rows in batches:
                costs[layout][rows] = step_ms(engine, state, decode, rows, args.steps)
                print(f"measured: {layout} cache, {rows} rows: {costs[layout][rows]:.3f} ms/step", flush=True)
                if args.profile:
                    print_profile(engine, state, decode, rows, 10, args.profile)
        torch._dynamo.reset()
    print_table(costs, batches)


def print_table(costs: dict[str, dict[int, float]], batches: list[int]) -> None:
    """Each measured layout's ms per step and its ratio to the first batch's, and paged over static with both."""
    layouts = list(costs)
    both = len(layouts) == 2
    header = "".join(f" {layout} ms/step | × {batches[0]} row{'s' * (batches[0] > 1)} |" for layout in layouts)
    print(f"\n| rows |{header}" + (" paged / static |" if both else ""))
    print("|---|" + "---|---|" * len(layouts) + ("---|" if both else ""))
    for rows in batches:
        cells = "".join(f" {costs[c][rows]:.3f} | {costs[c][rows] / costs[c][batches[0]]:.2f} |" for c in layouts)
        ratio = f" {costs['paged'][rows] / costs['static'][rows]:.2f} |" if both else ""
        print(f"| {rows} |{cells}{ratio}")


if __name__ == "__main__":
    main()
