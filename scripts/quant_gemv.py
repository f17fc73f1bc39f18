"""Time the decode step's quantized matrix-vector products on a GPU, for choosing the Triton kernels' tiles:
x [1, K] bf16 against each weight matrix of Llama-2-7B, Llama-3-8B and SmolLM2-135M, quantized int8 and int4
(group 128), with

- ``bf16``: cuBLAS on the bf16 weights (what decode does unquantized; the speed to beat);
- ``triton ...``: our kernels (:mod:`gpt_fast.kernels.triton_gemv`) over a grid of tiles (``--sweep``), or with the
  tiles the code chooses;
- ``aten``: PyTorch's ``_weight_int8pack_mm`` / ``_weight_int4pack_mm`` (tinygemm), where this build has them;
- ``inductor``: the plain-PyTorch dequantize-then-linear (:mod:`gpt_fast.quant.products`' ``dequant``) compiled by
  inductor with gpt-fast's settings (upstream gpt-fast's int8 formula).

Each variant is checked against a float64 product with the dequantized weights, then timed in a CUDA graph over
enough weight copies (>= 400 MB) that none stays in L2 between uses. Prints one JSON line per measurement and a
table of the best of each kind per matrix.

    python scripts/quant_gemv.py [--sweep] [--matrices w13,w2,...] [--json_out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import gemv_floor  # scripts/gemv_floor.py, beside this file
import torch
import torch.nn.functional as F

from gpt_fast.kernels import triton_gemv
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import weight_shapes
from gpt_fast.quant.products import group_interleave, int4_dequantize, int8_interleave
from gpt_fast.quant.schemes import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
from gpt_fast.util.fileio import write_text_atomic
from gpt_fast.util.settings import apply_torch_settings

MATRICES = gemv_floor.MATRICES | {  # name: (model shape, weight)
    "smol_w13": ("smollm2-135m", "layers.0.feed_forward.w13.weight"),
    "smol_w2": ("smollm2-135m", "layers.0.feed_forward.w2.weight"),
}
GROUP = 128
ROTATION_BYTES = 400_000_000
Fn = Callable[[torch.Tensor, tuple[torch.Tensor, ...]], torch.Tensor]


def launches(scheme: str, sweep: bool, n: int, k: int) -> list[triton_gemv.Launch | None]:
    if not sweep:
        return [None]
    if scheme == "int8":  # interleaved words: rows, 512 or 1024 columns per warp per step, warps
        tiles = itertools.product((4, 8, 16), (512, 1024), (1, 2, 4))
        return [triton_gemv.Launch(rows, columns * warps, warps) for rows, columns, warps in tiles]
    # int4: rows, columns per step (whole groups), warps, -, float16 pairs
    grid = itertools.product((4, 8, 16), (1024, 2048, 4096), (1, 2, 4), (False,), (False, True))
    return [triton_gemv.Launch(*config) for config in grid]


def variants(scheme: str, sweep: bool, n: int, k: int) -> dict[str, Fn]:
    out: dict[str, Fn] = {}
    if scheme == "bf16":
        return {"bf16 cublas": lambda x, w: F.linear(x, w[0])}
    for launch in launches(scheme, sweep, n, k):
        kind = {"int8": "triton-interleaved", "int4": "triton-half2" if launch and launch.half2 else "triton"}[scheme]
        name = kind + " " + ("chosen" if launch is None else f"n{launch.block_n} k{launch.block_k} w{launch.warps}")
        if scheme == "int8":  # the words of int8_interleave
            out[name] = lambda x, w, launch=launch: triton_gemv.int8_gemv(x, w[2], w[1], launch)
        else:
            out[name] = lambda x, w, launch=launch: triton_gemv.int4_gemv(x, w[3], w[1], w[2], GROUP, launch)
    if scheme == "int8":  # the matrix as it is (float32 models, other widths)
        out["triton-matrix chosen"] = lambda x, w: triton_gemv.int8_gemv(x, w[0], w[1])
    torch._dynamo.reset()
    if scheme == "int8":
        out["aten _weight_int8pack_mm"] = lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w[0], w[1])
        out["inductor dequant"] = torch.compile(lambda x, w: F.linear(x, w[0].to(x.dtype)) * w[1])
    else:
        out["aten _weight_int4pack_mm"] = lambda x, w: torch.ops.aten._weight_int4pack_mm(x, w[4], GROUP, w[5])
        out["inductor dequant"] = torch.compile(lambda x, w: F.linear(x, int4_dequantize(w[0], w[1], w[2], GROUP)))
    return out


def quantized(scheme: str, weight: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The tensors of ``weight`` in ``scheme`` (also our Triton kernel's words; int4: tinygemm's layout) and the
    float64 matrix they mean."""
    if scheme == "bf16":
        return (weight,), weight.double()
    if scheme == "int8":
        q, s = quantize_int8(weight, torch.bfloat16)
        return (q, s, int8_interleave(q)), dequantize_int8(q, s).double()
    q, s, z = quantize_int4(weight, GROUP, torch.bfloat16)
    tensors: tuple[torch.Tensor, ...] = (q, s, z, group_interleave(q, GROUP))
    try:  # tinygemm: even columns in the high nibble, [K / group, N, 2] scales and zeros
        levels = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(q.shape[0], -1)
        tiny = ((levels[:, 0::2] << 4) | levels[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(tiny, 8)
        tensors += (packed, torch.stack([s, z], dim=-1).transpose(0, 1).contiguous())
    except RuntimeError as err:
        print(json.dumps({"note": f"no tinygemm layout: {str(err).splitlines()[0]}"}))
    return tensors, dequantize_int4(q, s, z, GROUP).double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--matrices", default=",".join(MATRICES))
    parser.add_argument("--schemes", default="bf16,int8,int4")
    parser.add_argument("--json_out", default=None)
    args = parser.parse_args()
    apply_torch_settings()
    rows = []
    for name in args.matrices.split(","):
        model_shape, weight_name = MATRICES[name]
        n, k = weight_shapes(get_shape(model_shape))[weight_name]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for scheme in args.schemes.split(","):
            first, reference = quantized(scheme, torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
            stored = first[:2] if scheme == "int8" else first[:3]  # the checkpoint's tensors, not repacked copies
            nbytes = sum(t.numel() * t.element_size() for t in stored)
            count = max(2, -(-ROTATION_BYTES // nbytes))
            copies = [first] + [
                quantized(scheme, torch.randn_like(reference, dtype=torch.bfloat16))[0] for _ in range(count - 1)
            ]
            expected = x.double() @ reference.T
            for variant, fn in variants(scheme, args.sweep, n, k).items():
                try:
                    error = ((fn(x, first).double() - expected).norm() / expected.norm()).item()
                    us = gemv_floor.microseconds_per_call(fn, copies, x)
                except Exception as err:  # a kernel this build lacks, or a tile that does not compile
                    print(json.dumps({"matrix": name, "variant": variant, "error": str(err).splitlines()[0][:200]}))
                    continue
                row = {"matrix": name, "n": n, "k": k, "scheme": scheme, "variant": variant, "us": us}
                row |= {"GBps": nbytes / us / 1e3, "rel_error": error}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del copies
            torch.cuda.empty_cache()
    if args.json_out:
        write_text_atomic(Path(args.json_out), json.dumps(rows) + "\n")
    summary(rows)


def summary(rows: list[dict]) -> None:
    """The best variant of each kind per matrix and scheme."""
    print("| matrix | scheme | kind | best variant | µs | GB/s | rel. error |")
    print("|---|---|---|---|---|---|---|")
    best: dict[tuple[str, str, str], dict] = {}
    for row in rows:
        key = (row["matrix"], row["scheme"], row["variant"].split()[0])
        if key not in best or row["us"] < best[key]["us"]:
            best[key] = row
    for (matrix, scheme, kind), row in best.items():
        print(
            f"| {matrix} | {scheme} | {kind} | {row['variant']} | {row['us']:.1f} | {row['GBps']:.0f} | "
            f"{row['rel_error']:.1e} |"
        )


if __name__ == "__main__":
    main()
