"""Triton kernels for batch-invariant steps (``--batch_invariant``): a linear layer and an RMSNorm whose result for a
row does not depend on how many rows are computed with it.

The number of rows is a run-time argument that Triton does not specialize on, and every tile is chosen from the
weight's shape alone: a row is computed by the same compiled code, in the same order, whether the step has one row or
seventeen. So a verify step over k + 1 positions rounds each position exactly as a one-position decode step does.

The linear layer multiplies :data:`ROWS_PER_PROGRAM` rows at a time on the tensor cores (``tl.dot``), rows past the
step's last one loaded as zeros: one element of the result is one sequence of matrix-multiply instructions over its
row and column whatever the other rows hold. A verify step's rows then read each weight once, as a decode step's
single row does; a kernel of one program per row reads them once per row (a 7B verify step over 5 positions then
costs 2.5 decode steps: docs/bench/HISTORY.md, 2026-11-23f).

Imported only where Triton is (:mod:`gpt_fast.accel.invariant` decides); the launchers run on CUDA tensors, and in
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ROWS_PER_PROGRAM = 16  # the tensor cores' smallest tile height; fixed, whatever the step's row count


@dataclass(frozen=True)
class Launch:
    """The linear layer's tile: output channels per program, input columns per step, warps, pipeline stages."""

    block_n: int
    block_k: int
    warps: int
    stages: int


def linear_launch(k: int) -> Launch:
    """The tile for a weight of ``k`` input columns (never the row count): 32 output channels per program, 4
    warps; 128 columns per step in 5 stages, or from 2048 columns on 256 in 4. Measured on an H200 over a grid of
    tiles (``scripts/invariant_kernels.py --sweep``, docs/bench/HISTORY.md, 2026-11-23g): at the SmolLM2 and Llama-2-7B
    shapes, the best single tile for the sum over a step's linear layers, and within 6 % of each matrix's best
    tile."""
    return Launch(32, 256, 4, 4) if k >= 2048 else Launch(32, 128, 4, 5)


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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program ``(n block, m block)``: ``y[rows, n] = x[rows] @ w[n].T (+ b[n])`` for BLOCK_M rows (those from ``M``
    on are zeros) and BLOCK_N channels, accumulated in float32 (``IEEE``: float32 inputs multiplied exactly, not as
    TF32; ``UPCAST``: every input made float32 first, for Triton's interpreter, whose ``dot`` mishandles
    bfloat16)."""
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_at = x_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]  # [BLOCK_M, BLOCK_K]
    w_at = w_ptr + rn.to(tl.int64)[None, :] * K + rk[:, None]  # [BLOCK_K, BLOCK_N]: the weight's rows as columns
    m_in = rm[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            x = tl.load(x_at, mask=m_in, other=0.0)
            w = tl.load(w_at)
        else:
            k_in = k0 + rk
            x = tl.load(x_at, mask=m_in & (k_in[None, :] < K), other=0.0)
            w = tl.load(w_at, mask=(rn[None, :] < N) & (k_in[:, None] < K), other=0.0)
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_at += BLOCK_K
        w_at += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_at = y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=m_in & (rn[None, :] < N))


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
    grid = (triton.cdiv(n, launch.block_n), triton.cdiv(m, ROWS_PER_PROGRAM))
    _rows_linear[grid](
        x,
        weight,
        weight if bias is None else bias,
        y,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        BLOCK_M=ROWS_PER_PROGRAM,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        EVEN=even,
        IEEE=x.dtype == torch.float32,
        UPCAST=x.device.type == "cpu",  # only the interpreter runs a kernel on CPU tensors
        num_warps=launch.warps,
        num_stages=launch.stages,
    )
    return y


@triton.jit
def _rows_rms_norm(x_ptr, w_ptr, y_ptr, dim, eps, offset, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``row``: the row normalized in float32; times the weight after rounding (Llama) or times
    ``offset + weight`` in float32 (``OFFSET``, Gemma), as :class:`gpt_fast.model.transformer.RMSNorm` rounds."""
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
