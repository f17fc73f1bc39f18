"""Triton pieces that a decode step's GEMVs compute around their products, shared by our kernels
(:mod:`gpt_fast.kernels.triton_linear`, :mod:`gpt_fast.kernels.triton_gated_activation`) and the quantized ones
(:mod:`gpt_fast.kernels.triton_gemv`), which is why it sits beside both rather than in either: the RMSNorm of a row
before a product, a gated MLP's activation after ``w13``, each rounded as the model's PyTorch code rounds.

Imported only where Triton is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def inverse_rms(x_ptr, K, eps, ROW_K: tl.constexpr, NORM: tl.constexpr) -> tl.tensor:
    """With ``NORM``, ``rsqrt(mean(x**2) + eps)`` of the row ``x`` [K] in float32 (the whole row in one load: each
    program needs it before its first product); else 1."""
    if NORM:
        cols = tl.arange(0, ROW_K)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        return tl.rsqrt(tl.sum(x * x, 0) / K + eps)
    else:
        return 1.0


@triton.jit
def gated(gate, up, dtype, GELU: tl.constexpr) -> tl.tensor:
    """``act(gate) * up`` in ``dtype`` from ``gate`` and ``up`` in float32 (values of ``dtype``), rounded as
    :func:`gpt_fast.model.transformer.gated` rounds: the activation in float32, rounded to ``dtype``, then the product
    in float32, rounded again. ``gelu_tanh`` is GeLU's tanh approximation, written through ``exp`` (Triton has no
    portable tanh)."""
    if GELU:  # x (1 + tanh(z)) / 2 = x sigmoid(2z), z = sqrt(2 / pi) (x + 0.044715 x^3): no cancellation for x < 0
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(dtype).to(tl.float32)
    return (act * up).to(dtype)


def checked_norm_weight(x: torch.Tensor, norm_weight: torch.Tensor | None, unread: torch.Tensor) -> torch.Tensor:
    """The kernels' norm weight argument: ``norm_weight`` [K] (in ``x``'s dtype), or without a norm ``unread``."""
    if norm_weight is None:
        return unread
    assert norm_weight.shape == (x.shape[1],) and norm_weight.dtype == x.dtype and norm_weight.is_contiguous()
    return norm_weight
