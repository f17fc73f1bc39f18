"""The batch-invariant Triton kernels against the reference operators of :mod:`gpt_fast.accel.invariant`, run as a
script in a process of its own with ``TRITON_INTERPRET=1`` (the interpreter test) or imported on a GPU (the GPU
tests): prints, as JSON, the worst relative error per dtype and whether every row of a many-row launch equals, bit
for bit, the same row launched alone.

Cases: linear layers with and without bias, tiles that divide the shape and tiles that do not, rows of one program
and of two; RMSNorm with and without Gemma's offset; attention of 5 query positions per row (MHA and GQA, head_dim 16
and 64, each row at its own positions, cache rows after the first, one split and several, a sliding window with
soft-capping), whose result must also not change in a longer cache.
"""

from __future__ import annotations

import json
import sys

import torch

from gpt_fast.accel.invariant import reference_attention, reference_linear, reference_rms_norm
from gpt_fast.kernels import triton_decode_attention, triton_invariant

# (rows, out features, in features, bias, launch (block_n, block_k, warps, stages) or None: the default)
LINEARS = [
    (5, 40, 96, True, (16, 32, 1, 1)),
    (9, 37, 100, False, None),
    (1, 64, 576, False, None),
    (20, 48, 64, True, None),
]
NORMS = [(7, 48, 0.0), (3, 576, 1.0)]
# (batch, cache rows, first row, heads, kv heads, head_dim, cache length, first positions, window, softcap, launch)
ATTENTIONS = [
    (1, 1, 0, 4, 4, 16, 64, [20], None, None, None),
    (2, 3, 1, 6, 2, 64, 300, [200, 37], None, None, (16, 64, 4, 32)),
    (2, 2, 0, 9, 3, 64, 256, [0, 120], 50, 30.0, None),
]
T = 5  # query positions per row
# positions a longer cache adds: with the cases' splits of 64, 64 and 32 positions, 1 split becomes 3 (the
# combination of splits where the shorter cache has none), 5 become 6, 8 become 11, the last split ragged in each
LONGER = 72


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def linear_cases(dtype: torch.dtype, device: str) -> tuple[float, bool]:
    worst, alike = 0.0, True
    for rows, n, k, has_bias, launch in LINEARS:
        generator = torch.Generator().manual_seed(n + k)
        x, weight = torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator)
        bias = torch.randn(n, generator=generator) if has_bias else None
        x, weight = x.to(device, dtype), weight.to(device, dtype)
        bias = None if bias is None else bias.to(device, dtype)
        tile = None if launch is None else triton_invariant.Launch(*launch)
        out = triton_invariant.rows_linear(x, weight, bias, tile)
        worst = max(worst, relative_error(out, reference_linear(x, weight, bias)))
        alone = torch.cat([triton_invariant.rows_linear(x[i : i + 1], weight, bias, tile) for i in range(rows)])
        alike &= torch.equal(out, alone)
    return worst, alike


def norm_cases(dtype: torch.dtype, device: str) -> tuple[float, bool]:
    worst, alike = 0.0, True
    for rows, dim, offset in NORMS:
        generator = torch.Generator().manual_seed(dim)
        x = torch.randn(rows, dim, generator=generator).to(device, dtype)
        weight = torch.randn(dim, generator=generator).to(device, dtype)
        out = triton_invariant.rows_rms_norm(x, weight, 1e-6, offset)
        worst = max(worst, relative_error(out, reference_rms_norm(x, weight, 1e-6, offset)))
        alone = torch.cat([triton_invariant.rows_rms_norm(x[i : i + 1], weight, 1e-6, offset) for i in range(rows)])
        alike &= torch.equal(out, alone)
    return worst, alike


def attention_inputs(case: tuple, dtype: torch.dtype, device: str) -> tuple:
    bsz, cache_rows, first_row, n_head, n_kv, head_dim, length, firsts, window, softcap, launch = case
    generator = torch.Generator().manual_seed(length + head_dim)
    qkv = torch.randn(bsz, T, (n_head + 2 * n_kv) * head_dim, generator=generator).to(device, dtype)
    q, k, v = qkv.split([n_head * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)  # views, as the model's
    q, k, v = q.view(bsz, T, n_head, head_dim), k.view(bsz, T, n_kv, head_dim), v.view(bsz, T, n_kv, head_dim)
    positions = (torch.tensor(firsts)[:, None] + torch.arange(T)).to(device)  # [B, T]
    angles = torch.randn(bsz, T, head_dim // 2, generator=generator).to(device)
    kv = torch.randn(2, cache_rows, n_kv, length, head_dim, generator=generator).to(device, dtype)
    tile = None if launch is None else triton_decode_attention.Launch(*launch)
    return q, k, v, angles.cos(), angles.sin(), kv, positions, first_row, head_dim**-0.5, softcap, window, tile


def attention_cases(dtype: torch.dtype, device: str) -> tuple[float, bool]:
    worst, alike = 0.0, True
    for case in ATTENTIONS:
        q, k, v, cos, sin, kv, positions, first_row, scale, softcap, window, tile = attention_inputs(
            case, dtype, device
        )
        expected_kv = kv.clone()
        expected = reference_attention(q, k, v, cos, sin, expected_kv, positions, first_row, scale, softcap, window)
        got_kv = kv.clone()
        out = triton_decode_attention.rows_attention(
            q, k, v, cos, sin, got_kv, positions, first_row, scale, softcap, window, tile
        )
        worst = max(worst, relative_error(out, expected), relative_error(got_kv, expected_kv))
        alone_kv = kv.clone()
        alone = [
            triton_decode_attention.rows_attention(
                *(x[:, t : t + 1] for x in (q, k, v, cos, sin)),
                alone_kv,
                positions[:, t : t + 1],
                first_row,
                scale,
                softcap,
                window,
                tile,
            )
            for t in range(T)
        ]
        alike &= torch.equal(out, torch.cat(alone, dim=1)) and torch.equal(got_kv, alone_kv)
        alike &= torch.equal(
            out, in_a_longer_cache(q, k, v, cos, sin, kv, positions, first_row, scale, softcap, window, tile)
        )
    return worst, alike


def in_a_longer_cache(q, k, v, cos, sin, kv, positions, first_row, scale, softcap, window, tile) -> torch.Tensor:
    """The attention with the same keys in a cache :data:`LONGER` positions longer (a request for more tokens): a
    token's result must not depend on the cache's length."""
    longer = torch.zeros(*kv.shape[:3], kv.shape[3] + LONGER, kv.shape[4], dtype=kv.dtype, device=kv.device)
    longer[:, :, :, : kv.shape[3]] = kv
    return triton_decode_attention.rows_attention(
        q, k, v, cos, sin, longer, positions, first_row, scale, softcap, window, tile
    )


def report(device: str, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> dict[str, float | bool]:
    """On the CPU (Triton's interpreter) a float32 ``tl.dot`` is numpy's sgemm, which on some CPUs rounds one row of
    a 16-row tile otherwise than the others (seen with numpy 2.3.5's OpenBLAS on an AMD EPYC: row 6): that case's
    row equality is the interpreter's, reported apart as ``rows_alike_cpu_sgemm``; on a GPU it counts in
    ``rows_alike``. For ``dtypes``: the worst error of each, by name."""
    result: dict[str, float | bool] = {"rows_alike": True, "rows_alike_cpu_sgemm": True}
    for dtype in dtypes:
        errors = []
        for cases in (linear_cases, norm_cases, attention_cases):
            error, alike = cases(dtype, device)
            errors.append(error)
            key = (
                "rows_alike_cpu_sgemm"
                if device == "cpu" and cases is linear_cases and dtype == torch.float32
                else "rows_alike"
            )
            result[key] = result[key] and alike
        result[str(dtype).removeprefix("torch.")] = max(errors)
    return result


if __name__ == "__main__":  # python invariant_reference.py [DEVICE [DTYPE]]
    chosen = (getattr(torch, sys.argv[2]),) if len(sys.argv) > 2 else (torch.float32, torch.bfloat16)
    json.dump(report(sys.argv[1] if len(sys.argv) > 1 else "cpu", chosen), sys.stdout)
