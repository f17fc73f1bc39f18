"""Time the quantized products of activations with each weight matrix of Llama-2-7B, Llama-3-8B and SmolLM2-135M on
a GPU: x [M, K] bf16 (M = ``--rows``, 1 for a decode step, 8 to 64 for the server's batched steps) against the
matrix quantized int8 (a scale per row) and int4 (group 128), with

- ``bf16``: cuBLAS on the bf16 weights (what decode does unquantized; the speed to beat);
- ``ours``: the quantized layer as a model runs it (:mod:`gpt_fast.quant.layers`, kernel ``triton``: our GEMV
  for few rows, our Triton matrix product for more);
- ``triton ...``: our GEMV kernels (:mod:`gpt_fast.kernels.triton_gemv`) over a grid of tiles (``--sweep``, one row),
  or with the chosen tile's loop over K pipelined by Triton in each of ``--stages`` (its ``num_stages``; one row);
- ``aten``: PyTorch's ``_weight_int8pack_mm`` / ``_weight_int4pack_mm`` (tinygemm), where this build has them;
- ``inductor``: the plain-PyTorch dequantize-then-linear (:mod:`gpt_fast.quant.products`' ``dequant``) compiled by
  inductor with gpt-fast's settings (upstream gpt-fast's int8 formula);
- ``gemlite``: gemlite's A16W8 (int8, a scale per row) and A16W4 (HQQ's grouped int4) Triton kernels on the same
  integers, where ``gemlite`` is importable, with its own autotuning (its default, ``fast``) done before timing.

Each variant is checked against a float64 product with the dequantized weights, then timed in a CUDA graph over
enough weight copies (>= 400 MB) that none stays in L2 between uses. Prints one JSON line per measurement and a
table of the best of each kind per matrix and row count.

    python scripts/quant_gemv.py [--sweep] [--rows 1,8,32,64] [--matrices w13,w2,...] [--kinds ours,gemlite]
        [--stages 1,2,3,4] [--json_out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import gemv_floor  # scripts/gemv_floor.py, beside this file
import torch
import torch.nn.functional as F
from torch import nn

from gpt_fast.kernels import triton_gemv
from gpt_fast.kernels.gemlite_int8 import gemlite_importable, gemlite_int8_product, gemlite_int8_weights
from gpt_fast.model.config import QuantConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import weight_shapes
from gpt_fast.quant.layers import LINEARS, QuantizedLinear
from gpt_fast.quant.products import int4_aten_linear, int4_dequantize, load_kernel, resolve_kernel
from gpt_fast.quant.schemes import INT4_MID, dequantize_int4, dequantize_int8, quantize_int4, quantize_int8, unpack_int4
from gpt_fast.util.fileio import write_text_atomic
from gpt_fast.util.settings import apply_torch_settings

MATRICES = gemv_floor.MATRICES | {  # name: (model shape, weight)
    "smol_w13": ("smollm2-135m", "layers.0.feed_forward.w13.weight"),
    "smol_w2": ("smollm2-135m", "layers.0.feed_forward.w2.weight"),
}
GROUP = 128
ROTATION_BYTES = 400_000_000
Copy = dict[str, object]  # one copy of a matrix: its tensors by name, and the layers built from them
Fn = Callable[[torch.Tensor, Copy], torch.Tensor]


def launches(scheme: str, sweep: bool) -> list[triton_gemv.Launch | None]:
    if not sweep:
        return [None]
    if scheme == "int8":  # interleaved words: rows, 512 or 1024 columns per warp per step, warps
        tiles = itertools.product((4, 8, 16), (512, 1024), (1, 2, 4))
        return [triton_gemv.Launch(rows, columns * warps, warps) for rows, columns, warps in tiles]
    # int4: rows, columns per step (whole groups), warps, -, float16 pairs
    grid = itertools.product((4, 8, 16), (1024, 2048, 4096), (1, 2, 4), (False,), (False, True))
    return [triton_gemv.Launch(*config) for config in grid]


def staged_variants(scheme: str, stages: list[int]) -> dict[str, Fn]:
    """Our GEMV with the tile the code chooses, its loop over K pipelined by Triton in each number of ``stages``."""
    out: dict[str, Fn] = {}
    for count in stages:
        if scheme == "int8":
            out[f"triton-interleaved chosen s{count}"] = functools.partial(_staged_int8, stages=count)
        else:
            out[f"triton-half2 chosen s{count}"] = functools.partial(_staged_int4, stages=count)
    return out


def _staged_int8(x: torch.Tensor, w: Copy, stages: int) -> torch.Tensor:
    words = w["ours"].words
    launch = dataclasses.replace(triton_gemv.int8_launch(words.shape[0], x.shape[1], True), stages=stages)
    return triton_gemv.int8_gemv(x, words, w["scales"], launch)


def _staged_int4(x: torch.Tensor, w: Copy, stages: int) -> torch.Tensor:
    launch = dataclasses.replace(triton_gemv.int4_launch(w["scales"].shape[0], GROUP), stages=stages)
    return triton_gemv.int4_gemv(x, w["ours"].words, w["scales"], w["zeros"], GROUP, launch)


def gemv_variants(scheme: str, sweep: bool) -> dict[str, Fn]:
    """Our GEMV kernels called directly, with the tiles the code chooses or (``sweep``) each of a grid."""
    out: dict[str, Fn] = {}
    for launch in launches(scheme, sweep):
        kind = {"int8": "triton-interleaved", "int4": "triton-half2" if launch and launch.half2 else "triton"}[scheme]
        name = kind + " " + ("chosen" if launch is None else f"n{launch.block_n} k{launch.block_k} w{launch.warps}")
        if scheme == "int8":  # the words of int8_interleave
            out[name] = lambda x, w, launch=launch: triton_gemv.int8_gemv(x, w["ours"].words, w["scales"], launch)
        else:
            out[name] = lambda x, w, launch=launch: triton_gemv.int4_gemv(
                x, w["ours"].words, w["scales"], w["zeros"], GROUP, launch
            )
    if scheme == "int8":  # the matrix as it is (float32 models, other widths)
        out["triton-matrix chosen"] = lambda x, w: triton_gemv.int8_gemv(x, w["weight"], w["scales"])
    return out


def variants(scheme: str, sweep: bool, rows: int, stages: list[int]) -> dict[str, Fn]:
    if scheme == "bf16":
        return {"bf16 cublas": lambda x, w: F.linear(x, w["weight"])}
    out: dict[str, Fn] = {"ours layer": lambda x, w: w["ours"](x)}
    if rows == 1:
        out |= gemv_variants(scheme, sweep) | staged_variants(scheme, stages)
    torch._dynamo.reset()
    if scheme == "int8":
        out["aten _weight_int8pack_mm"] = lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w["weight"], w["scales"])
        out["inductor dequant"] = torch.compile(lambda x, w: F.linear(x, w["weight"].to(x.dtype)) * w["scales"])
    else:
        out["aten _weight_int4pack_mm"] = lambda x, w: int4_aten_linear(
            x, w["aten"].packed, w["aten"].scales_and_zeros, GROUP
        )
        out["inductor dequant"] = torch.compile(
            lambda x, w: F.linear(x, int4_dequantize(w["weight"], w["scales"], w["zeros"], GROUP))
        )
    if gemlite_importable():
        out["gemlite"] = lambda x, w: w["gemlite"](x)
    return out


def layer(scheme: str, tensors: dict[str, torch.Tensor], kernel: str) -> QuantizedLinear:
    """Our quantized layer holding ``tensors`` (the checkpoint's), prepared for ``kernel`` as a model's would be."""
    n, k = tensors["scales"].shape[0], tensors["weight"].shape[1] * (2 if scheme == "int4" else 1)
    quant = QuantConfig(mode=scheme, group_size=GROUP if scheme == "int4" else None)
    with torch.device("meta"):
        out = LINEARS[scheme](k, n, quant, bias=False)
    for name, tensor in tensors.items():
        setattr(out, name, nn.Parameter(tensor, requires_grad=False))
    resolved = resolve_kernel(kernel, tensors["scales"].device)
    load_kernel(resolved)
    out.prepare(resolved)
    return out


def gemlite_layer(scheme: str, tensors: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """gemlite's product on the same integers: int8 as ``--quant_kernel gemlite`` runs it
    (:mod:`gpt_fast.kernels.gemlite_int8`); int4 as gemlite's A16W4 in HQQ's form, ``(q - z) * s`` with
    ``z = 8 - zero / scale`` for our ``(q - 8) * scale + zero``."""
    if not gemlite_importable():
        return None
    if scheme == "int8":
        weights = gemlite_int8_weights(tensors["weight"], tensors["scales"])
        return functools.partial(gemlite_int8_product, weights=weights)
    from gemlite.helper import A16W4_HQQ_INT

    scales, zeros = tensors["scales"], tensors["zeros"]  # [N, groups]
    hqq_zeros = INT4_MID - zeros.float() / scales.float()
    levels = unpack_int4(tensors["weight"])  # [N, K]
    return A16W4_HQQ_INT(device="cuda", dtype=torch.bfloat16).from_weights(levels, scales, hqq_zeros)


def quantized(scheme: str, weight: torch.Tensor) -> tuple[Copy, torch.Tensor, int]:
    """One copy of ``weight`` in ``scheme`` (the checkpoint's tensors, our layer, the other kernels' layouts), the
    float64 matrix it means and the checkpoint's bytes."""
    if scheme == "bf16":
        return {"weight": weight}, weight.double(), weight.numel() * weight.element_size()
    if scheme == "int8":
        q, s = quantize_int8(weight, torch.bfloat16)
        tensors, reference = {"weight": q, "scales": s}, dequantize_int8(q, s).double()
    else:
        q, s, z = quantize_int4(weight, GROUP, torch.bfloat16)
        tensors, reference = {"weight": q, "scales": s, "zeros": z}, dequantize_int4(q, s, z, GROUP).double()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    copy: Copy = dict(tensors)
    copy["ours"] = layer(scheme, tensors, "triton")
    if scheme == "int4":  # tinygemm's layout: a layer prepared for ``aten`` on CUDA keeps it
        copy["aten"] = layer(scheme, tensors, "aten")
    copy["gemlite"] = gemlite_layer(scheme, tensors)
    return copy, reference, nbytes


def measure(name: str, scheme: str, args: argparse.Namespace) -> list[dict]:
    """Every variant of ``scheme`` on matrix ``name``, at each row count."""
    model_shape, weight_name = MATRICES[name]
    n, k = weight_shapes(get_shape(model_shape))[weight_name]
    first, reference, nbytes = quantized(scheme, torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    count = max(2, -(-ROTATION_BYTES // nbytes))
    copies = [first] + [
        quantized(scheme, torch.randn(n, k, device="cuda", dtype=torch.bfloat16))[0] for _ in range(count - 1)
    ]
    out = []
    stages = [int(count) for count in args.stages.split(",")] if args.stages else []
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        expected = x.double() @ reference.T
        for variant, fn in variants(scheme, args.sweep, rows, stages).items():
            if args.kinds and variant.split()[0] not in args.kinds.split(","):
                continue
            try:
                error = ((fn(x, first).double() - expected).norm() / expected.norm()).item()
                us = gemv_floor.microseconds_per_call(fn, copies, x)
            except Exception as err:  # a kernel this build lacks, or a tile that does not compile
                note = {"matrix": name, "rows": rows, "variant": variant, "error": str(err).splitlines()[0][:200]}
                print(json.dumps(note), flush=True)
                continue
            row = {"matrix": name, "n": n, "k": k, "rows": rows, "scheme": scheme, "variant": variant, "us": us}
            row |= {"GBps": nbytes / us / 1e3, "rel_error": error}
            out.append(row)
            print(json.dumps(row), flush=True)
    del copies, first
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="our GEMV over a grid of tiles (one row)")
    parser.add_argument("--rows", default="1", help="activation rows, comma-separated (e.g. 1,8,32,64)")
    parser.add_argument("--matrices", default=",".join(MATRICES))
    parser.add_argument("--schemes", default="bf16,int8,int4")
    parser.add_argument("--kinds", default="", help="only these kinds (ours,triton,aten,inductor,gemlite,bf16)")
    parser.add_argument("--stages", default="", help="one row: the chosen tile also at these num_stages (e.g. 1,2,3,4)")
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    apply_torch_settings()
    rows = [
        row
        for name in args.matrices.split(",")
        for scheme in args.schemes.split(",")
        for row in measure(name, scheme, args)
    ]
    if args.json_out:
        write_text_atomic(Path(args.json_out), json.dumps(rows) + "\n")
    summary(rows)


def summary(rows: list[dict]) -> None:
    """The best variant of each kind per matrix, row count and scheme."""
    print("| matrix | rows | scheme | kind | best variant | µs | GB/s | rel. error |")
    print("|---|---|---|---|---|---|---|---|")
    best: dict[tuple[str, int, str, str], dict] = {}
    for row in rows:
        key = (row["matrix"], row["rows"], row["scheme"], row["variant"].split()[0])
        if key not in best or row["us"] < best[key]["us"]:
            best[key] = row
    for (matrix, m, scheme, kind), row in best.items():
        print(
            f"| {matrix} | {m} | {scheme} | {kind} | {row['variant']} | {row['us']:.1f} | {row['GBps']:.0f} | "
            f"{row['rel_error']:.1e} |"
        )


if __name__ == "__main__":
    main()
