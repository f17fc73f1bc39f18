"""Triton kernel for a decode step's unquantized linear layer: one row of activations against a whole weight matrix.

Each program owns ``BLOCK_N`` output channels and walks the input dimension in steps of ``BLOCK_K`` columns,
keeping a float32 partial product per loaded weight and reducing once at the end. The first step's weights are
loaded before the kernel waits for its activations (:mod:`gpt_fast.kernels.pdl`), so that in a CUDA graph
the loads start while the kernel before it drains. The tile, 4 channels × 1024 columns × 4 warps, is the fastest
of seven in a chain of a Llama-2-7B layer's four GEMVs each after a small kernel, in a CUDA graph on an H200:
102 µs per layer (3961 GB/s) against 117 µs for cuBLAS (docs/bench/HISTORY.md, 2026-11-24b).

A gated MLP's ``w13`` (gate rows, then up rows) has a kernel of its own, :func:`gated_gemv`: each program owns
``BLOCK_N / 2`` hidden units, reads their gate and up rows (the same tile, so the same loads as the plain GEMV)
and writes ``act(gate) * up`` itself, so that the activation is no kernel of its own.

Imported only where Triton is (:mod:`gpt_fast.accel.linear` decides); the launcher runs on CUDA tensors, and in
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpt_fast.kernels.pdl import pdl_launch, wait_for_inputs
from gpt_fast.kernels.row import ACTIVATIONS, checked_norm_weight, gated, inverse_rms

BLOCK_N = 4  # output channels per program
BLOCK_K = 1024  # input columns per step (fewer for a narrower matrix)
WARPS = 4


@triton.jit
def _weights(w_rows, rn, kk, N, K, EVEN: tl.constexpr):
    """The weight tile [BLOCK_N, BLOCK_K] of channels ``rn``, columns ``kk`` in float32: masked (zeros outside)
    unless the tiles cover the matrix exactly."""
    if EVEN:
        w = tl.load(w_rows + kk[None, :])
    else:
        w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
    return w.to(tl.float32)


@triton.jit
def _activations(x_ptr, kk, K, EVEN: tl.constexpr):
    """The activations [BLOCK_K] of columns ``kk`` in float32."""
    if EVEN:
        x = tl.load(x_ptr + kk)
    else:
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _inputs(x_ptr, g_ptr, kk, K, inv_rms, EVEN: tl.constexpr, NORM: tl.constexpr):
    """The product's inputs [BLOCK_K] of columns ``kk`` in float32: the activations, or with ``NORM`` their RMSNorm with
    weight ``g``, rounded where :func:`gpt_fast.model.transformer.rms_norm` rounds (the normed row, then its product
    with the weight, each to the activations' dtype)."""
    x = _activations(x_ptr, kk, K, EVEN)
    if NORM:
        dtype = x_ptr.dtype.element_ty
        normed = (x * inv_rms).to(dtype).to(tl.float32)
        x = (_activations(g_ptr, kk, K, EVEN) * normed).to(dtype).to(tl.float32)
    return x


@triton.jit
def _linear_gemv(
    x_ptr,
    w_ptr,
    b_ptr,
    r_ptr,
    g_ptr,
    y_ptr,
    N,
    K,
    eps,
    HAS_BIAS: tl.constexpr,
    RESIDUAL: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_K: tl.constexpr,
    EVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    """``y`` [N] = ``w`` [N, K] @ ``x`` [K] (+ ``b`` [N]), rounded to ``y``'s dtype; with ``NORM`` the product takes
    RMSNorm(``x``) with weight ``g`` [K] and ``eps``; with ``RESIDUAL``, ``r`` [N] + the rounded product, rounded."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    kk = tl.arange(0, BLOCK_K)
    w = _weights(w_rows, rn, kk, N, K, EVEN)  # before the wait: the weights do not depend on the kernel before
    wait_for_inputs(PDL)
    inv_rms = inverse_rms(x_ptr, K, eps, ROW_K, NORM)
    acc = w * _inputs(x_ptr, g_ptr, kk, K, inv_rms, EVEN, NORM)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        acc += _weights(w_rows, rn, kk, N, K, EVEN) * _inputs(x_ptr, g_ptr, kk, K, inv_rms, EVEN, NORM)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    if RESIDUAL:
        y = y.to(dtype).to(tl.float32) + tl.load(r_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(dtype), mask=rn < N)


@triton.jit
def _gated_gemv(
    x_ptr,
    w_ptr,
    g_ptr,
    y_ptr,
    hidden,
    K,
    eps,
    GELU: tl.constexpr,
    NORM: tl.constexpr,
    HALF_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROW_K: tl.constexpr,
    EVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    """``y`` [hidden] = act(gate) * up, where gate, up = ``w`` [2 * hidden, K] @ ``x`` [K], each rounded to ``y``'s
    dtype first (as the model's ``w13`` output is); with ``NORM``, of RMSNorm(``x``) as in :func:`_linear_gemv`."""
    rn = tl.program_id(0) * HALF_N + tl.arange(0, HALF_N)
    gate_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    up_rows = w_ptr + (rn + hidden).to(tl.int64)[:, None] * K
    kk = tl.arange(0, BLOCK_K)
    wg = _weights(gate_rows, rn, kk, hidden, K, EVEN)  # before the wait, as in _linear_gemv
    wu = _weights(up_rows, rn, kk, hidden, K, EVEN)
    wait_for_inputs(PDL)
    inv_rms = inverse_rms(x_ptr, K, eps, ROW_K, NORM)
    x = _inputs(x_ptr, g_ptr, kk, K, inv_rms, EVEN, NORM)[None, :]
    acc_gate, acc_up = wg * x, wu * x
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = _inputs(x_ptr, g_ptr, kk, K, inv_rms, EVEN, NORM)[None, :]
        acc_gate += _weights(gate_rows, rn, kk, hidden, K, EVEN) * x
        acc_up += _weights(up_rows, rn, kk, hidden, K, EVEN) * x
    dtype = y_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
    tl.store(y_ptr + rn, gated(gate, up, dtype, GELU), mask=rn < hidden)


def linear_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """``x`` [1, K] @ ``weight`` [N, K].T (+ ``bias`` [N]) -> [1, N] in ``x``'s dtype; with ``norm_weight`` [K], of
    RMSNorm(``x``) (weight ``norm_weight``, epsilon ``eps``) instead of ``x``; with ``residual`` [1, N], plus it
    (each rounded as the model rounds)."""
    assert x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous()
    n, k = weight.shape
    assert residual is None or (residual.shape == (1, n) and residual.is_contiguous() and residual.dtype == x.dtype)
    block_k = min(BLOCK_K, triton.next_power_of_2(k))
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _linear_gemv[(triton.cdiv(n, BLOCK_N),)](
        x,
        weight,
        bias if bias is not None else weight,  # not read without a bias
        residual if residual is not None else weight,  # nor without a residual
        checked_norm_weight(x, norm_weight, weight),
        y,
        n,
        k,
        eps,
        HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None,
        NORM=norm_weight is not None,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        ROW_K=triton.next_power_of_2(k),
        EVEN=n % BLOCK_N == 0 and k % block_k == 0,
        num_warps=WARPS,
        **pdl_launch(x.device),
    )
    return y


def gated_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    activation: str,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """A gated MLP's hidden state ``act(gate) * up`` [1, hidden] for ``x`` [1, K] (with ``norm_weight``,
    RMSNorm(``x``) as in :func:`linear_gemv`) and ``weight`` [2 * hidden, K] (gate rows, then up rows), in ``x``'s
    dtype; ``activation``: ``silu`` or ``gelu_tanh``."""
    assert x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous() and activation in ACTIVATIONS
    n, k = weight.shape
    hidden, half_n = n // 2, BLOCK_N // 2
    block_k = min(BLOCK_K, triton.next_power_of_2(k))
    y = torch.empty((1, hidden), dtype=x.dtype, device=x.device)
    _gated_gemv[(triton.cdiv(hidden, half_n),)](
        x,
        weight,
        checked_norm_weight(x, norm_weight, weight),
        y,
        hidden,
        k,
        eps,
        GELU=activation == "gelu_tanh",
        NORM=norm_weight is not None,
        HALF_N=half_n,
        BLOCK_K=block_k,
        ROW_K=triton.next_power_of_2(k),
        EVEN=hidden % half_n == 0 and k % block_k == 0,
        num_warps=WARPS,
        **pdl_launch(x.device),
    )
    return y
