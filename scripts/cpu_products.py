"""The default model's quantized products on the CPU, as its layers compute them: our C++ kernels (``cpp``, and
``cpp-q8``: AVX512-VNNI's integer products where the CPU has them, else AVX2's) against PyTorch's own weight-only
kernels (``aten``) for a decode step's rows; and, for ``cpp``, the same products by each of our paths: the tile
kernels (``int8_matmul``, ``int4_matmul``: a prompt's rows), the few-rows kernels (``int8_gemv``, ``int4_gemv``: a
decode step's) and torch's matrix product on the weights dequantized whole (int4: by our C++ code; the path past
``CPP_MATMUL_ROWS`` rows). Random weights of the SmolLM2-135M shape (30 layers of wqkv, wo, w13, w2, each its own
weights, so that a step reads them from memory as a model does; ``table``: the output projection of the default
model's int8 table, 49152 rows in groups of 32); each figure is the best of ``--repeats`` timings.

usage: python scripts/cpu_products.py [--threads 1] [--rows 1,4,8,16,35] [--kinds cpp,cpp-q8,aten] [--repeats 5]
       [--no_avx512]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpt_fast.kernels import cpu_gemv
from gpt_fast.model.config import EmbeddingQuant, QuantConfig
from gpt_fast.quant.layers import Int4Linear, Int8Linear
from gpt_fast.quant.products import load_kernel, resolve_kernel
from gpt_fast.quant.schemes import quantize_int4, quantize_int8

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: wqkv, wo, w13, w2 as [N, K]
TABLE = (49152, 576)  # its tied embedding table, the output projection
GROUP = 32


def layers(scheme: str, kernel: str) -> list[torch.nn.Module]:
    """A step's quantized layers (``scheme`` int8 or int4 g32; ``table``: the output projection alone, int8 g32),
    prepared for ``kernel``."""
    load_kernel(resolve_kernel(kernel, torch.device("cpu")))
    torch.manual_seed(0)
    made: list[torch.nn.Module] = []
    if scheme == "table":
        q, s = quantize_int8(torch.randn(*TABLE), torch.float32, GROUP)
        table = Int8Linear(TABLE[1], TABLE[0], EmbeddingQuant("int8", GROUP), bias=False)
        table.load_state_dict({"weight": q, "scales": s}, assign=True)
        table.prepare(kernel)
        return [table]
    for _ in range(LAYERS):
        for n, k in SHAPES:
            if scheme == "int8":
                q, s = quantize_int8(torch.randn(n, k), torch.float32)
                layer: torch.nn.Module = Int8Linear(k, n, QuantConfig("int8"), bias=False)
                layer.load_state_dict({"weight": q, "scales": s}, assign=True)
            else:
                q, s, z = quantize_int4(torch.randn(n, k), GROUP, torch.float32)
                layer = Int4Linear(k, n, QuantConfig("int4", GROUP), bias=False)
                layer.load_state_dict({"weight": q, "scales": s, "zeros": z}, assign=True)
            layer.prepare(kernel)
            made.append(layer)
    return made


def best_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best


def through_layers(step: list[torch.nn.Module], xs: dict[int, torch.Tensor]) -> Callable[[], object]:
    return lambda: [layer(xs[layer.in_features]) for layer in step]


def paths(scheme: str, step: list[torch.nn.Module], xs: dict[int, torch.Tensor]) -> list[Callable[[], object]]:
    """A step's products of ``scheme`` (int8 or int4) by the tile kernel, the few-rows kernel and torch's matrix
    product on the weights dequantized whole, in that order."""
    if scheme == "int8":
        return [
            lambda: [cpu_gemv.int8_matmul(xs[m.in_features], m.weight, m.scales, None) for m in step],
            lambda: [cpu_gemv.int8_gemv(xs[m.in_features], m.weight, m.scales) for m in step],
            lambda: [F.linear(xs[m.in_features], m.weight.float()) * m.scales for m in step],
        ]
    return [
        lambda: [cpu_gemv.int4_matmul(xs[m.in_features], m.weight, m.scales, m.zeros, GROUP) for m in step],
        lambda: [cpu_gemv.int4_gemv(xs[m.in_features], m.weight, m.scales, m.zeros, GROUP) for m in step],
        lambda: [
            F.linear(xs[m.in_features], cpu_gemv.int4_dequantize(m.weight, m.scales, m.zeros, GROUP)) for m in step
        ],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,8,16,35", help="activation rows, comma-separated")
    parser.add_argument("--kinds", default="cpp,aten", help="the decode step's kernels: cpp, cpp-q8, aten")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--no_avx512", action="store_true", help="our kernels without their AVX-512 code, as on a CPU without it"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_gemv.load_cpu_kernels()
    avx512 = torch.ops.gpt_fast.set_avx512(not args.no_avx512)  # the setting in force
    rows = [int(r) for r in args.rows.split(",")]
    capability = torch.backends.cpu.get_cpu_capability()
    print(
        f"CPU capability {capability}, our kernels' AVX-512 code {'on' if avx512 else 'off'}, "
        f"cpp-q8 through {'vpdpbusd' if cpu_gemv.q8_vnni() else 'vpmaddubsw'}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(
        "| scheme | kernel | rows | ms per step's products (120; table: 1) "
        "| cpp: tile / few-rows kernel / dequantized + F.linear (ms) |"
    )
    print("|---|---|---|---|---|")
    for scheme in ("int8", "int4", "table"):
        for kind in args.kinds.split(","):
            if scheme == "table" and kind == "aten":  # PyTorch's kernel has no scales per group
                continue
            step = layers(scheme, kind)
            for m in rows if kind.startswith("cpp") else rows[:1]:
                xs = {k: torch.randn(m, k) for k in (576, 1536)}
                ms = best_ms(through_layers(step, xs), args.repeats)
                direct = ""
                if kind == "cpp" and scheme != "table" and m > 1:
                    direct = " / ".join(f"{best_ms(run, args.repeats):.2f}" for run in paths(scheme, step, xs))
                print(f"| {scheme} | {kind} | {m} | {ms:.2f} | {direct} |", flush=True)


if __name__ == "__main__":
    main()
