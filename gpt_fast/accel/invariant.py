"""Batch-invariant decode and verify steps (``--batch_invariant``): every token's row computed the same way whatever
else the step computes, so that speculative decoding gives plain decoding's text token for token in any dtype.

A verify step runs the model over k + 1 positions where a decode step runs it over one. With the usual kernels the two
round differently (a matrix product over k + 1 rows is not k + 1 matrix-vector products; inductor fuses and tunes the
two graphs apart), and in bfloat16 that flips near-ties: on an H200, prompt lookup at 3.01x plain decoding gives a text
that leaves plain decoding's at token 93 (docs/bench/HISTORY.md, 2026-11-22c and 2026-11-22g). In a batch-invariant step
each reduction over a row (the linear layers, the RMSNorms, the attention of a query) is an operator whose result for a
row does not depend on the other rows:

- on a CUDA GPU with Triton (not ROCm), Triton kernels whose compiled code and order for a row do not depend on
  the number of rows: the linear layers multiply a fixed 16 rows at a time on the tensor cores (rows past the last
  are zeros), the RMSNorm and the attention give each row (each query) programs of its own
  (:mod:`gpt_fast.kernels.triton_invariant`, and :func:`gpt_fast.kernels.triton_decode_attention.rows_attention`);
- elsewhere (the CPU, ROCm), the PyTorch code run one row at a time: the same operation on the same shapes for a
  decode step's row as for each of a verify step's rows. Correct everywhere; on a GPU a verify step then reads the
  weights once per position.

Each is a ``torch.library.custom_op``, opaque to ``torch.compile``: inductor neither fuses it with its neighbours
nor re-tunes it per graph. What remains to inductor between them is elementwise (residual additions, the gated
activation, the embedding), which rounds each element alike in every graph once the compiled steps emulate eager
rounding (:func:`gpt_fast.generation.decode.compile_options`, ``exact``). The prefill of a prompt, and any product of
more than :data:`INVARIANT_ROWS` rows, keeps the usual kernels: plain and speculative decoding share the prefill.

Not covered, and refused by the engine: mixtures of experts, quantized checkpoints, tensor parallelism.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from gpt_fast.accel.linear import swap_linears
from gpt_fast.kernels.available import triton_usable
from gpt_fast.model.config import ModelConfig, QuantConfig
from gpt_fast.model.transformer import Attention, RMSNorm, Transformer, apply_rope, attend_softcapped, rms_norm

INVARIANT_ROWS = 64  # rows (batch x positions) of a step that the invariant operators take; more: the usual kernels


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [M, K] through ``F.linear`` one row at a time: [M, N]."""
    return torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(x.shape[0])])


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """:func:`gpt_fast.model.transformer.rms_norm` over the rows of ``x`` [M, D] one at a time."""
    return torch.cat([rms_norm(x[i : i + 1], weight, eps, offset) for i in range(x.shape[0])])


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    input_pos: torch.Tensor,
    first_row: int,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """The arguments and result of :func:`gpt_fast.kernels.triton_decode_attention.rows_attention`, in the model's
    PyTorch code: the rotary embedding, every new key and value written into ``kv``, then each query position on its
    own (SDPA, or the soft-capped attention, over the cache with that position's mask)."""
    bsz, seqlen, n_head, head_dim = q.shape
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    positions = input_pos.expand(bsz, seqlen)  # [B, T]
    rows = torch.arange(first_row, first_row + bsz, device=q.device)[:, None]  # [B, 1]
    kv[:, rows, :, positions] = torch.stack((k, v), dim=2)  # [B, T, 2, H_kv, D]
    keys, values = kv[0, first_row : first_row + bsz], kv[1, first_row : first_row + bsz]  # [B, H_kv, S, D]
    key_pos = torch.arange(kv.shape[3], device=q.device)
    seen = key_pos <= positions[..., None]  # [B, T, S]
    if window is not None:
        seen &= positions[..., None] - key_pos < window
    masks = torch.where(seen, 0.0, float("-inf")).to(q.dtype)[:, :, None, None]  # [B, T, 1, 1, S]
    outs = [_attend_one(q[:, t, :, None], keys, values, masks[:, t], scale, softcap) for t in range(seqlen)]
    return torch.stack(outs, dim=1)  # [B, T, H, D]


def _attend_one(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """One query position ``q`` [B, H, 1, D] over the cache [B, H_kv, S, D] with ``mask`` [B, 1, 1, S]: [B, H, D]."""
    if softcap is not None:
        y = attend_softcapped(q, keys, values, mask, scale, softcap)
    else:
        gqa = q.shape[1] != keys.shape[1]
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa, scale=scale)
    return y[:, :, 0]


@functools.cache
def register_ops() -> None:
    """Register the reference functions above as the operators ``torch.ops.gpt_fast.invariant_linear``,
    ``invariant_rms_norm`` and ``invariant_attention`` (which writes into ``kv``), for every device, eagerly
    (``torch.compile`` cannot trace a registration). Nothing happens at import."""
    for name, function, mutates in (
        ("linear", reference_linear, ()),
        ("rms_norm", reference_rms_norm, ()),
        ("attention", reference_attention, ("kv",)),
    ):
        torch.library.custom_op(f"gpt_fast::invariant_{name}", function, mutates_args=mutates)
    # the shapes of their results, for tracing; contiguous, as every implementation returns them
    torch.library.register_fake("gpt_fast::invariant_linear", lambda x, w, _b: x.new_empty(x.shape[0], w.shape[0]))
    torch.library.register_fake("gpt_fast::invariant_rms_norm", lambda x, *_args: x.new_empty(x.shape))
    torch.library.register_fake("gpt_fast::invariant_attention", lambda q, *_args: q.new_empty(q.shape))


@functools.cache
def register_triton_kernels() -> None:
    """Give the operators the Triton kernels on CUDA devices (call only where :func:`triton_usable`)."""
    from gpt_fast.kernels import triton_decode_attention, triton_invariant

    register_ops()

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return triton_invariant.rows_linear(x, weight, bias)

    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        return triton_invariant.rows_rms_norm(x, weight, eps, offset)

    def attention(*args: object) -> torch.Tensor:
        return triton_decode_attention.rows_attention(*args)

    for name, kernel in (("linear", linear), ("rms_norm", norm), ("attention", attention)):
        torch.library.register_kernel(f"gpt_fast::invariant_{name}", "cuda", kernel)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with each of up to :data:`INVARIANT_ROWS` rows of ``x`` [..., K] computed on its own."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > INVARIANT_ROWS:
        return F.linear(x, weight, bias)
    return torch.ops.gpt_fast.invariant_linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """:func:`gpt_fast.model.transformer.rms_norm` of each row of ``x`` [B, T, ..., D] (T positions of B sequences: up
    to :data:`INVARIANT_ROWS` of them; a q/k norm's heads are rows too) on its own."""
    if x.shape[0] * x.shape[1] > INVARIANT_ROWS:
        return rms_norm(x, weight, eps, offset)
    rows = x.reshape(-1, x.shape[-1])
    return torch.ops.gpt_fast.invariant_rms_norm(rows, weight, eps, offset).view(x.shape)


def invariant_attention(*args: object) -> torch.Tensor:
    """What :class:`gpt_fast.model.transformer.Attention` calls as its ``rows_kernel``: the operator, with the
    arguments of :func:`reference_attention`. Over a static cache only: a paged cache's steps keep the model's
    PyTorch code (:meth:`gpt_fast.model.transformer.Attention.attend`)."""
    return torch.ops.gpt_fast.invariant_attention(*args)


class InvariantLinear(nn.Linear):
    """An ``nn.Linear`` (the same parameters) computed by :func:`invariant_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


def check_invariant(config: ModelConfig, quantization: QuantConfig | None) -> None:
    """Refuse what the invariant operators do not cover (before any weights are read): a mixture of experts, a
    quantized checkpoint."""
    if config.is_moe:
        raise ValueError("--batch_invariant does not cover mixtures of experts yet")
    if quantization is not None:
        raise ValueError("--batch_invariant does not cover quantized checkpoints yet")


def use_invariant_kernels(model: Transformer, device: torch.device) -> None:
    """Make every step of ``model`` batch-invariant: its linear layers :class:`InvariantLinear` (sharing their
    parameters), its norms, attention and tied output projection the invariant operators, Triton's where
    :func:`triton_usable` says so (the engine has called :func:`check_invariant`)."""
    register_ops()
    if triton_usable(device):
        register_triton_kernels()
    swap_linears(model, InvariantLinear)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = invariant_rms_norm
        if isinstance(module, Attention):
            module.rows_kernel = invariant_attention
    model.head_kernel = invariant_linear
