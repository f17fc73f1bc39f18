"""Triton kernels for batch-invariant steps (``--batch_invariant``): a linear layer and an RMSNorm whose result for a
row does not depend on how many rows are computed with it.

Each program computes one row (and, for the linear layer, one block of its outputs), with a tile chosen from the
weight's shape alone, and the number of rows is a run-time argument that Triton does not specialize on: a row's
program runs the same compiled code, in the same order, whether the step has one row or seventeen. So a verify step
over k + 1 positions rounds each position exactly as a one-position decode step does.

The linear layer is a matrix-vector product per row, like the quantized ones (:mod:`gpt_fast.quant.triton_gemv`):
partial products accumulate per loaded weight in float32 registers and are reduced once at the end; programs are
numbered row-fastest, so the programs of all rows that read one block of weights run side by side and all but the
first find it in L2.

Imported only where Triton is (:mod:`gpt_fast.kernels.invariant` decides); the launchers run on CUDA tensors, and in
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Launch:
    """The linear layer's tile: output channels per program, input columns per step, warps."""

    block_n: int
    block_k: int
    warps: int


def linear_launch(k: int) -> Launch:
    """The tile for a weight of ``k`` input columns: 2 output channels of up to 1024 columns per step, 4 warps (each
    thread loads 16 bytes of bfloat16 per channel and step), as the int8 kernel's. Chosen by reasoning, not
    measured."""
    return Launch(2, min(1024, triton.next_power_of_2(k)), 4)


@triton.jit(do_not_specialize=["M"])
def _rows_linear(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Program ``(n block) * M + row``: ``y[row, n] = x[row] . w[n] (+ b[n])`` for the block's channels."""
    pid = tl.program_id(0)
    m = pid % M
    rn = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_row = x_ptr + m.to(tl.int64) * K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(x_row + kk)
            w = tl.load(w_rows + kk[None, :])
        else:
            x = tl.load(x_row + kk, mask=kk < K, other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * N + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


def rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, launch: Launch | None = None
) -> torch.Tensor:
    """``x`` [M, K] @ ``weight`` [N, K].T (+ ``bias`` [N]) -> [M, N] in ``x``'s dtype, each row on its own."""
    m, k = x.shape
    n = weight.shape[0]
    launch = launch or linear_launch(k)
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    even = k % launch.block_k == 0 and n % launch.block_n == 0
    _rows_linear[(m * triton.cdiv(n, launch.block_n),)](
        x,
        weight,
        weight if bias is None else bias,
        y,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        EVEN=even,
        num_warps=launch.warps,
    )
    return y


@triton.jit
def _rows_rms_norm(x_ptr, w_ptr, y_ptr, dim, eps, offset, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``row``: the row normalized in float32; times the weight after rounding (Llama) or times
    ``offset + weight`` in float32 (``OFFSET``, Gemma), as :class:`gpt_fast.model.RMSNorm` rounds."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < dim
    x = tl.load(x_ptr + row * dim + cols, mask=inside, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    normed = x / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    dtype = y_ptr.dtype.element_ty
    if OFFSET:
        y = normed * (offset + w)
    else:
        y = w * normed.to(dtype).to(tl.float32)
    tl.store(y_ptr + row * dim + cols, y.to(dtype), mask=inside)


def rows_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMSNorm of every row of ``x`` [..., D] with ``weight`` [D] (see :func:`_rows_rms_norm`), in ``x``'s dtype."""
    dim = x.shape[-1]
    rows = x.contiguous().view(-1, dim)
    y = torch.empty_like(rows)
    _rows_rms_norm[(rows.shape[0],)](
        rows, weight, y, dim, eps, offset, OFFSET=offset != 0.0, BLOCK=triton.next_power_of_2(dim)
    )
    return y.view(x.shape)
