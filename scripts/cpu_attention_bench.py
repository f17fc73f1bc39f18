"""Time our C++ decode attention (``gpt_fast::decode_attention_cpu``) over the default model's 30 layers, one step:
the rotary embedding, the cache write and the attention of ``--rows`` rows at ``--positions``, in caches of each
layout (static; paged, blocks of 16 in shuffled order, positions first in a block or ``paged-heads``: each kv head's
positions in one run) and dtype (the model's float32, or any other ``--kv_cache_dtype`` but auto: float16, bfloat16,
float8_e4m3fn). Between two steps a 70 MB buffer is read, as the weights of a real step are, so that the caches come
from memory. Variants are interleaved round by round so that the machine's drift falls on each alike; each variant's
median over ``--rounds`` is printed as a ``measured:`` line (scripts/ab_trees.sh collects them). A variant this
tree's operator refuses (an older tree's layouts and dtypes) prints ``refused``.

    python scripts/cpu_attention_bench.py [--rows 1,4] [--positions 135,512] [--caches static,paged,paged-heads]
        [--dtypes float32,float16] [--rounds 15] [--threads N]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from gpt_fast.kernels.cpu_gemv import load_cpu_kernels
from gpt_fast.model.shapes import get_shape
from gpt_fast.util.device import KV_DTYPES
from gpt_fast.util.settings import apply_torch_settings

LAYERS = 30
BLOCK = 16
FLUSH_BYTES = 70 * 2**20


def make_cache(layout: str, dtype: torch.dtype, rows: int, length: int, heads: int, dim: int) -> dict:
    """One layer's cache and block table: each row's ``length`` positions, paged in shuffled blocks."""
    if layout == "static":
        return {"kv": torch.randn(2, rows, heads, length, dim).to(dtype), "table": None}
    width = -(-length // BLOCK)
    blocks = rows * width + 1  # block 0 is the sink
    if layout == "paged-heads":
        kv = torch.randn(2, blocks, heads, BLOCK, dim).to(dtype).transpose(2, 3)  # [2, N, BLOCK, H_kv, D]
    else:
        kv = torch.randn(2, blocks, BLOCK, heads, dim).to(dtype)
    table = (torch.randperm(rows * width) + 1).view(rows, width)
    return {"kv": kv, "table": table}


def step(caches: list[dict], inputs: tuple, positions: torch.Tensor, scale: float) -> None:
    q, k, v, cos, sin = inputs
    for cache in caches:
        args = (q, k, v, cos, sin, cache["kv"], positions, 0, scale, None, None, cache["table"])
        torch.ops.gpt_fast.decode_attention_cpu(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--positions", default="135,512")
    parser.add_argument("--caches", default="static,paged,paged-heads")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    apply_torch_settings(torch.device("cpu"), compiled=False, threads=args.threads)
    load_cpu_kernels()
    shape = get_shape("smollm2-135m")
    heads, kv_heads, dim = shape.n_head, shape.n_local_heads, shape.head_dim
    flush = torch.ones(FLUSH_BYTES // 4)
    variants = {}
    for rows, position, layout, dtype in itertools.product(
        [int(n) for n in args.rows.split(",")],
        [int(n) for n in args.positions.split(",")],
        args.caches.split(","),
        args.dtypes.split(","),
    ):
        caches = [make_cache(layout, KV_DTYPES[dtype], rows, position + 1, kv_heads, dim) for _ in range(LAYERS)]
        inputs = (
            torch.randn(rows, 1, heads, dim),
            torch.randn(rows, 1, kv_heads, dim),
            torch.randn(rows, 1, kv_heads, dim),
            torch.randn(rows, 1, dim // 2),
            torch.randn(rows, 1, dim // 2),
        )
        positions = torch.full((rows, 1), position, dtype=torch.long)
        name = f"rows {rows} position {position} cache {layout} {dtype}"
        try:
            step(caches, inputs, positions, dim**-0.5)
        except RuntimeError as err:
            print(f"{name}: refused ({str(err).splitlines()[0]})", flush=True)
            continue
        variants[name] = (caches, inputs, positions, [])
    for _ in range(args.rounds):
        for caches, inputs, positions, times in variants.values():
            flush.sum()
            start = time.perf_counter()
            step(caches, inputs, positions, dim**-0.5)
            times.append(time.perf_counter() - start)
    for name, (*_, times) in variants.items():
        print(f"measured: {name}: {1e3 * statistics.median(times):.2f} ms a step", flush=True)


if __name__ == "__main__":
    main()
