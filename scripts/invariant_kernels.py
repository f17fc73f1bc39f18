"""Time the batch-invariant step's Triton kernels on a GPU, for choosing their tiles (``--batch_invariant``,
:mod:`gpt_fast.kernels.triton_invariant`): a verify step's linear layers and attention over 1, 5 and 9 rows (a
decode step, and verify steps of k = 4 and k = 8), for SmolLM2-135M and Llama-2-7B shapes, bf16.

- ``linear``: cuBLAS (``F.linear``, the usual kernels' matrix product, not batch-invariant) against the invariant
  kernel with the tile the code chooses and, with ``--sweep``, a grid of tiles; each checked first: every row of the
  many-row launch equal, bit for bit, to the row launched alone. Timed in a CUDA graph over enough weight copies
  (>= 400 MB) that none stays in L2.
- ``attention``: the invariant attention (rotary, cache write, each query over the cache up to its position) with
  the split the code chooses and, with ``--sweep``, splits for other numbers of programs per row; timed over one
  cache per layer.

Prints one JSON line per measurement, then per model shape and tile the linear layers' time summed over one step
(every layer's four matrices and the output head).

    python scripts/invariant_kernels.py [--sweep] [--json_out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from pathlib import Path

import gemv_floor  # scripts/gemv_floor.py, beside this file
import torch
import torch.nn.functional as F
import triton

from gpt_fast.kernels import triton_decode_attention, triton_invariant
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import weight_shapes
from gpt_fast.util.fileio import write_text_atomic

SHAPES = ("smollm2-135m", "llama-2-7b")
MATRICES = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
ROWS = (1, 5, 9)
CACHE = 704  # positions: the real default model's benchmark (371-token prompt, 300 new tokens, rounded up)


def tiles(sweep: bool) -> list[triton_invariant.Launch | None]:
    if not sweep:
        return [None]
    grid = itertools.product((16, 32, 64), (128, 256, 512), ((4, 3), (4, 5), (8, 4)))
    return [None] + [triton_invariant.Launch(n, k, w, s) for n, k, (w, s) in grid]


def matrices(shape_name: str) -> dict[str, tuple[int, int, int]]:
    """name: (out features, in features, uses per step)."""
    config = get_shape(shape_name)
    shapes = weight_shapes(config)
    out = {m: (*shapes[f"layers.0.{m}.weight"], config.n_layer) for m in MATRICES}
    out["output"] = (config.vocab_size, config.dim, 1)
    return out


def linear_rows(shape_name: str, sweep: bool) -> list[dict]:
    rows = []
    for name, (n, k, uses) in matrices(shape_name).items():
        copies = max(1, gemv_floor.ROTATION_BYTES // (2 * n * k))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = x.double() @ weights[0].double().T
            variants = {"cublas": lambda x, w: F.linear(x, w)}
            for tile in tiles(sweep):
                label = "chosen" if tile is None else f"{tile.block_n}x{tile.block_k} w{tile.warps} s{tile.stages}"
                variants[label] = lambda x, w, tile=tile: triton_invariant.rows_linear(x, w, None, tile)
            for label, fn in variants.items():
                try:
                    got = fn(x, weights[0])
                    alike = label == "cublas" or torch.equal(
                        got, torch.cat([fn(x[i : i + 1], weights[0]) for i in range(m)])
                    )
                    us = gemv_floor.microseconds_per_call(fn, weights, x)
                except Exception as error:  # a tile the GPU cannot run (shared memory): reported
                    print(
                        json.dumps(
                            {
                                "shape": shape_name,
                                "matrix": name,
                                "rows": m,
                                "variant": label,
                                "error": str(error)[:120],
                            }
                        ),
                        flush=True,
                    )
                    continue
                error = ((got.double() - expected).norm() / expected.norm()).item()
                row = {
                    "shape": shape_name,
                    "matrix": name,
                    "n": n,
                    "k": k,
                    "uses": uses,
                    "rows": m,
                    "variant": label,
                    "us": us,
                    "rows_alike": alike,
                    "rel_error": error,
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def attention_rows(shape_name: str, sweep: bool) -> list[dict]:
    config = get_shape(shape_name)
    n_head, n_kv, head_dim = config.n_head, config.n_local_heads, config.head_dim
    group = n_head // n_kv
    launches = {"chosen": None}
    if sweep:
        block_s = triton_decode_attention.loop_step(group, head_dim)
        usual = triton_decode_attention.Launch(block_s, 4 * block_s, 4, triton.cdiv(CACHE, 4 * block_s))
        launches["usual splits"] = usual
        for programs in (32, 64, 256):  # splits never stretched: the cache's splits are the programs
            split_len = triton.cdiv(triton.cdiv(CACHE, triton.cdiv(programs, n_kv)), usual.block_s) * usual.block_s
            launches[f"{programs} programs"] = triton_decode_attention.Launch(
                usual.block_s, split_len, usual.warps, triton.cdiv(CACHE, split_len)
            )
    caches = [
        torch.randn(2, 1, n_kv, CACHE, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(config.n_layer)
    ]
    rows = []
    for m in ROWS:
        q = torch.randn(1, m, n_head, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, m, n_kv, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        angles = torch.randn(m, head_dim // 2, device="cuda")
        cos, sin = angles.cos(), angles.sin()
        positions = torch.arange(CACHE - 16, CACHE - 16 + m, device="cuda")
        inputs = (q, k, v, cos, sin)
        for label, launch in launches.items():

            def fn(pos, kv, inputs=inputs, launch=launch):
                return triton_decode_attention.rows_attention(*inputs, kv, pos, 0, head_dim**-0.5, None, None, launch)

            us = gemv_floor.microseconds_per_call(fn, caches, positions)
            row = {"shape": shape_name, "attention": True, "rows": m, "variant": label, "us": us}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def summary(rows: list[dict], shapes: tuple[str, ...]) -> None:
    """Per model shape, row count and variant: the linear layers' microseconds summed over one step."""
    step: dict[tuple, float] = defaultdict(float)
    counted: dict[tuple, int] = defaultdict(int)
    for r in rows:
        if "matrix" in r:
            step[(r["shape"], r["rows"], r["variant"])] += r["us"] * r["uses"]
            counted[(r["shape"], r["rows"], r["variant"])] += 1
    for shape in shapes:
        complete = len(matrices(shape))
        for m in ROWS:
            done = {v: t for (s, r, v), t in step.items() if s == shape and r == m and counted[(s, r, v)] == complete}
            best = sorted(done.items(), key=lambda item: item[1])[:6]
            print(
                f"{shape} rows={m}: "
                + "; ".join(f"{v} {t:.0f} us" for v, t in best)
                + f"; chosen {done.get('chosen', float('nan')):.0f}; cublas {done.get('cublas', float('nan')):.0f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="Also time a grid of tiles and splits.")
    parser.add_argument("--json_out", help="Write every measurement here as JSON.")
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        rows += attention_rows(shape, args.sweep)
        rows += linear_rows(shape, args.sweep)
        summary(rows, (shape,))
    if args.json_out:
        write_text_atomic(Path(args.json_out), json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
