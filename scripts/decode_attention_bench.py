"""Time one layer's attention part of a decode step on a GPU — rotary embedding of q and k, the k/v cache write and
the attention of the one query over the cache — as inductor compiles the model's PyTorch code (``torch``) and as
the fused Triton kernel does it (``triton``: the registered operator, compiled the same way, with the tile the code
chooses; ``--sweep``: the launcher over a grid of tiles too).

Shapes: Llama-2-7B (32 heads, head_dim 128), Llama-3-8B (32 heads over 8 kv heads) and SmolLM2-135M (9 heads over 3,
head_dim 64), one sequence, bf16, caches of 256 and 2048 positions with the query near the end (and, for Llama-2-7B,
at position 105: the average of ``bench_decode``'s 200 new tokens), and caches of 8192 (a server's, sized for the
model's context) with the query early and late. Each variant is checked against the PyTorch code,
then timed in a CUDA graph over one cache per layer (as the model has), so that caches leave L2 between uses as
they do in a decode step. Prints one JSON line per measurement and a table.

``--rows 1,8,64``: a server's step instead, the launcher alone: that many rows, each at its own position around
the middle of a 1024-position cache, static and paged (blocks of 16 in shuffled order), Llama-2-7B and Llama-3-8B
shapes (``--shapes``: some of them; ``--layouts``: static or paged alone), with the tile the code chooses for the
cache's dtype (and for another dtype than bfloat16, the tile a 16-bit cache takes), the tiles it chooses for the
run's other row counts, the one-row step's tile and (``--sweep``) a grid of tiles, over a cache of each of
``--cache_dtypes`` (bfloat16, and ``float8_e4m3fn``: ``--kv_cache_dtype``'s float8 cache); the table gives each
one's rate of reading the keys and values the rows see.

    python scripts/decode_attention_bench.py [--sweep] [--rows 1,8,64 [--shapes S] [--layouts L] [--cache_dtypes D]]
        [--json_out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import gemv_floor  # scripts/gemv_floor.py, beside this file
import torch

from gpt_fast.accel.decode_attention import fused_decode_attention, register_triton_ops, resolve_attention_kernel
from gpt_fast.generation.decode import compile_options
from gpt_fast.kernels import triton_decode_attention
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import apply_rope, attend_one_query, rope_tables
from gpt_fast.util.fileio import write_text_atomic
from gpt_fast.util.settings import apply_torch_settings

CASES = [  # (model shape, cache length, query position)
    ("llama-2-7b", 256, 105),
    ("llama-2-7b", 256, 250),
    ("llama-2-7b", 2048, 2040),
    ("llama-3-8b", 2048, 2040),
    ("smollm2-135m", 256, 250),
    ("smollm2-135m", 2048, 2040),
    ("smollm2-135m", 8192, 100),
    ("smollm2-135m", 8192, 8000),
    ("llama-3-8b", 8192, 100),
]


def torch_attention(inputs, kv):
    """The model's code for one layer of one decode step (``Attention.forward`` between the projections), the cache
    ``kv`` [2, 1, H_kv, S, D] written as ``KVCache.update`` writes it for one sequence. A tensor, not a module, so
    that the compiled function serves every layer's cache without recompiling."""
    q, k, v, cos, sin, input_pos, mask, scale = inputs
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    kv.index_copy_(3, input_pos, torch.stack((k, v)))
    return attend_one_query(q, kv[0], kv[1], mask, scale=scale).transpose(1, 2)


def fused_attention(inputs, kv):
    q, k, v, cos, sin, input_pos, _, scale = inputs
    return fused_decode_attention(q, k, v, cos, sin, kv, input_pos, 0, scale, None, None)


def launched(launch, table: torch.Tensor | None = None):
    def attention(inputs, kv):
        q, k, v, cos, sin, input_pos, _, scale = inputs
        return triton_decode_attention.decode_attention(
            q, k, v, cos, sin, kv, input_pos, 0, scale, None, None, table, launch=launch
        )

    return attention


def sweep_launches(
    length: int, sizes=(16, 32, 64, 128, 256), splits=(64, 128, 256, 512), dot: bool = False, warps=(2, 4, 8)
) -> list:
    """Tiles as given: splits of ``s`` positions over the whole cache, never stretched; at most 32 positions per
    warp in a loop step (the 7B's 256-position step over 8 warps already spills 572 bytes of registers); ``dot``:
    on the tensor cores (GQA)."""
    grid = itertools.product(sizes, (*splits, length), warps)
    return sorted(
        {
            triton_decode_attention.Launch(b, s, w, -(-length // s), dot)
            for b, s, w in grid
            if s % b == 0 and s <= length and b <= 32 * w
        },
        key=lambda launch: (launch.block_s, launch.split_len, launch.warps),
    )


def tile_name(launch) -> str:
    kind = "".join(
        name for name, on in (("dot ", launch.dot), ("fp16 ", launch.mma16), ("by-pos ", launch.acc_pos)) if on
    )
    return f"{kind}s{launch.block_s} split{launch.split_len} w{launch.warps}"


def reductions_tile(config, rows: int = 1):
    """For GQA shapes, the tile a float32 cache takes (the reductions, not the tensor cores); None otherwise."""
    tile = (config.n_head // config.n_local_heads, config.head_dim, config.n_local_heads)
    launch = triton_decode_attention.decode_launch(*tile, rows, torch.float32)
    return None if launch == triton_decode_attention.decode_launch(*tile, rows) else launch


def step_qkv(config, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's q [R, 1, H, D], k and v [R, 1, H_kv, D]: views of one projection output, as the model's."""
    n_head, n_kv, head_dim = config.n_head, config.n_local_heads, config.head_dim
    qkv = torch.randn(rows, 1, (n_head + 2 * n_kv) * head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([n_head * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    return q.view(rows, 1, n_head, head_dim), k.view(rows, 1, n_kv, head_dim), v.view(rows, 1, n_kv, head_dim)


def layer_caches(config, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """One filled cache buffer of ``shape`` and ``dtype`` per layer, as the model has."""
    return [torch.randn(shape, device="cuda").to(dtype) for _ in range(config.n_layer)]


def case_inputs(shape_name: str, length: int, pos: int) -> tuple[tuple, list[torch.Tensor]]:
    """The step's q, k, v (:func:`step_qkv`), rotary tables at the position, the position, the additive mask, the
    scale; and one filled cache per layer."""
    config = get_shape(shape_name)
    q, k, v = step_qkv(config, 1)
    cos, sin = rope_tables(config, length, "cuda")
    input_pos = torch.tensor([pos], device="cuda")
    key_pos = torch.arange(length, device="cuda")
    mask = torch.where(key_pos <= input_pos[..., None], 0.0, float("-inf")).to(torch.bfloat16)
    caches = layer_caches(config, (2, 1, config.n_local_heads, length, config.head_dim))  # KVCache's buffer
    return (q, k, v, cos[input_pos], sin[input_pos], input_pos, mask, config.head_dim**-0.5), caches


def measure(name: str, fn, inputs: tuple, caches: list[torch.Tensor], expected: torch.Tensor, case: tuple) -> dict:
    error = ((fn(inputs, caches[0]).double() - expected).norm() / expected.norm()).item()
    us = gemv_floor.microseconds_per_call(fn, caches, inputs)
    row = {"shape": case[0], "length": case[1], "pos": case[2], "variant": name, "us": us, "rel_error": error}
    print(json.dumps(row), flush=True)
    return row


ROW_CASES = [("llama-2-7b", 1024, 512), ("llama-3-8b", 1024, 512)]  # (model shape, cache length, mean position)
BLOCK_SIZE = 16  # the paged caches' (gpt-fast serve's default)


def rows_inputs(
    shape_name: str, length: int, pos: int, rows: int, paged: bool, dtype: torch.dtype
) -> tuple[tuple, list, object, int]:
    """A step of ``rows`` rows at positions spread over ``pos`` ± 64: the inputs as :func:`case_inputs` gives them
    (each row's own rotary tables and position), one filled cache of ``dtype`` per layer (paged: blocks of
    :data:`BLOCK_SIZE` in a shuffled table), the table (None: static) and the bytes of keys and values the rows see
    in one layer."""
    config = get_shape(shape_name)
    n_kv, head_dim = config.n_local_heads, config.head_dim
    q, k, v = step_qkv(config, rows)
    positions = (pos - 64 + torch.arange(rows, device="cuda") * 37 % 128).clamp(0, length - 1)  # [R]
    cos, sin = rope_tables(config, length, "cuda")
    input_pos = positions[:, None]  # [R, 1]
    mask = torch.where(torch.arange(length, device="cuda") <= input_pos, 0.0, float("-inf"))  # [R, S]
    mask = mask.to(torch.bfloat16)[:, None, None]  # [R, 1, 1, S]
    table, width = None, length // BLOCK_SIZE
    if paged:
        table = torch.randperm(rows * width, device="cuda").view(rows, width) + 1  # block 0: the sink
        shape = (2, rows * width + 1, BLOCK_SIZE, n_kv, head_dim)  # PagedKVCache's buffer
    else:
        shape = (2, rows, n_kv, length, head_dim)
    caches = layer_caches(config, shape, dtype)
    inputs = (q, k, v, cos[input_pos], sin[input_pos], input_pos, mask, head_dim**-0.5)
    seen = int((positions + 1).sum()) * 2 * n_kv * head_dim * dtype.itemsize
    return inputs, caches, table, seen


def rows_reference(inputs: tuple, kv: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    """The model's code for the rows' step, eager, on a copy of the cache seen as [2, R, H_kv, S, D] in the
    queries' dtype (the new keys and values rounded to the cache's first)."""
    q, k, v, cos, sin, input_pos, mask, scale = inputs
    if table is not None:
        kv = kv[:, table].flatten(2, 3).transpose(2, 3)  # [2, R, H_kv, S, D]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rows = torch.arange(q.shape[0], device=q.device)
    new = torch.stack((k[:, 0], v[:, 0]), dim=1).to(kv.dtype).to(q.dtype)  # [R, 2, H_kv, D]
    kv = kv.to(q.dtype, copy=True)
    kv[:, rows, :, input_pos[:, 0]] = new  # indexed dims first
    return attend_one_query(q.transpose(1, 2), kv[0], kv[1], mask, scale=scale).transpose(1, 2).double()


def measure_rows(args: argparse.Namespace) -> list[dict]:
    """The ``--rows`` cases: the chosen tile, the one-row step's and the sweep's, static and paged, with their
    reading rate."""
    results = []
    cases = [case for case in ROW_CASES if args.shapes is None or case[0] in args.shapes.split(",")]
    dtypes = [getattr(torch, name) for name in args.cache_dtypes.split(",")]
    row_counts = [int(r) for r in args.rows.split(",")]
    for (shape_name, length, pos), rows, paged, dtype in itertools.product(
        cases, row_counts, [layout == "paged" for layout in args.layouts.split(",")], dtypes
    ):
        inputs, caches, table, seen = rows_inputs(shape_name, length, pos, rows, paged, dtype)
        expected = rows_reference(inputs, caches[0], table)
        config = get_shape(shape_name)
        tile = (config.n_head // config.n_local_heads, config.head_dim, config.n_local_heads)
        launches = {"chosen": triton_decode_attention.decode_launch(*tile, rows, dtype)}
        if dtype != torch.bfloat16:  # what a 16-bit cache's step takes, for comparison
            launches["16-bit cache's tile"] = triton_decode_attention.decode_launch(*tile, rows)
        launches["one-row tile"] = triton_decode_attention.decode_launch(*tile)
        for other in row_counts:  # the cache's tiles for the run's other row counts, where they differ
            launch = triton_decode_attention.decode_launch(*tile, other, dtype)
            if launch not in launches.values():
                launches[f"{other}-row tile"] = launch
        if (reductions := reductions_tile(config, rows)) is not None:
            launches["reductions tile"] = reductions
        dot = tile[0] > 1  # GQA: the tensor cores' tiles (docs/bench/HISTORY.md, 2026-11-29: none of the others)
        for launch in sweep_launches(length, (16, 32, 64, 128), (32, 64, 128, 256), dot, (4, 8)) if args.sweep else ():
            launches[tile_name(launch)] = launch
        for name, launch in launches.items():
            fn = launched(launch, table)
            error = ((fn(inputs, caches[0].clone()).double() - expected).norm() / expected.norm()).item()
            us = gemv_floor.microseconds_per_call(fn, caches, inputs)
            layout = ("paged" if paged else "static") + ("" if dtype == torch.bfloat16 else f", {dtype}")
            row = {"shape": shape_name, "rows": rows, "layout": layout, "variant": name, "us": us}
            row |= {"gb_per_s": seen / us / 1e3, "rel_error": error}
            print(json.dumps(row), flush=True)
            results.append(row)
        del caches
        torch.cuda.empty_cache()
    return results


def rows_summary(results: list[dict]) -> None:
    print(
        "| shape | rows | cache | chosen tile (µs, GB/s) | one-row tile (µs, GB/s) | best tile (µs, GB/s) | "
        "rel. error |"
    )
    print("|---|---|---|---|---|---|---|")
    for case in dict.fromkeys((r["shape"], r["rows"], r["layout"]) for r in results):
        mine = [r for r in results if (r["shape"], r["rows"], r["layout"]) == case]
        chosen, one = (next(r for r in mine if r["variant"] == name) for name in ("chosen", "one-row tile"))
        best = min(mine, key=lambda r: r["us"])
        print(
            f"| {case[0]} | {case[1]} | {case[2]} | {chosen['us']:.1f}, {chosen['gb_per_s']:.0f} | "
            f"{one['us']:.1f}, {one['gb_per_s']:.0f} | "
            f"{best['variant']}: {best['us']:.1f}, {best['gb_per_s']:.0f} | {max(r['rel_error'] for r in mine):.1e} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--rows", default=None, help="Rows per step, comma-separated: a server's step (see above).")
    parser.add_argument("--shapes", default=None, help="With --rows: only these shapes, comma-separated.")
    parser.add_argument("--layouts", default="static,paged", help="With --rows: the caches, static and/or paged.")
    parser.add_argument("--cache_dtypes", default="bfloat16", help="With --rows: the caches' dtypes, comma-separated.")
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    apply_torch_settings()
    if args.rows is not None:
        results = measure_rows(args)
        if args.json_out:
            write_text_atomic(Path(args.json_out), json.dumps(results) + "\n")
        rows_summary(results)
        return
    gpu = torch.device("cuda")
    print(json.dumps({"attention_kernel_auto": resolve_attention_kernel("auto", gpu, "reduce-overhead")}))
    register_triton_ops()
    rows = []
    for case in CASES:
        inputs, caches = case_inputs(*case)
        torch._dynamo.reset()
        variants = {
            "torch (inductor)": torch.compile(torch_attention, options=compile_options("default"), fullgraph=True),
            "triton (operator, compiled)": torch.compile(
                fused_attention, options=compile_options("default"), fullgraph=True
            ),
        }
        config = get_shape(case[0])
        if (reductions := reductions_tile(config)) is not None:
            variants["triton, reductions tile"] = launched(reductions)
        for dot in (False, True) if config.n_head > config.n_local_heads else (False,):
            for launch in sweep_launches(case[1], dot=dot) if args.sweep else ():
                variants[f"triton {tile_name(launch)}"] = launched(launch)
        expected = torch_attention(inputs, caches[0].clone()).double()  # eager
        for name, fn in variants.items():
            rows.append(measure(name, fn, inputs, caches, expected, case))
        del caches
        torch.cuda.empty_cache()
    if args.json_out:
        write_text_atomic(Path(args.json_out), json.dumps(rows) + "\n")
    summary(rows)


def summary(rows: list[dict]) -> None:
    """Per case: inductor's time, the fused operator's, their ratio, and the best tile of the sweep."""
    print("| shape | cache | position | inductor (µs) | fused (µs) | speed-up | best tile (µs) | rel. error |")
    print("|---|---|---|---|---|---|---|---|")
    cases = dict.fromkeys((r["shape"], r["length"], r["pos"]) for r in rows)
    for case in cases:
        mine = [r for r in rows if (r["shape"], r["length"], r["pos"]) == case]
        base = next(r for r in mine if r["variant"].startswith("torch"))
        fused = next(r for r in mine if r["variant"].startswith("triton (operator"))
        best = min((r for r in mine if r["variant"].startswith("triton")), key=lambda r: r["us"])
        error = max(r["rel_error"] for r in mine)
        print(
            f"| {case[0]} | {case[1]} | {case[2]} | {base['us']:.2f} | {fused['us']:.2f} | "
            f"{base['us'] / fused['us']:.2f}× | {best['variant']}: {best['us']:.2f} | {error:.1e} |"
        )


if __name__ == "__main__":
    main()
