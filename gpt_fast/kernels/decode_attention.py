"""The attention of a decode step (one query position per row) as one fused kernel, or the model's PyTorch code.

- ``triton``: :mod:`gpt_fast.kernels.triton_decode_attention`, on CUDA GPUs: rotary embedding of the step's query
  and key, the cache write and the attention over the positions seen, in one kernel per layer (a second, small one
  combines the splits of a long cache), where inductor makes six of the PyTorch code. Wrapped as the
  ``torch.library.triton_op`` ``gpt_fast::decode_attention`` (it mutates the cache), so that ``torch.compile``
  places it in its own generated code and CUDA graphs capture it.
- ``torch``: the model's own code (:func:`gpt_fast.model.apply_rope`, :meth:`gpt_fast.cache.KVCache.update`,
  :func:`gpt_fast.model.attend_one_query`): runs everywhere, ROCm and the CPU included.

The model calls the kernel only in compiled decode steps: eager steps keep PyTorch's SDPA, which
:func:`gpt_fast.model.attend_one_query`'s docstring explains, and which makes eager decoding an independent
reference for the compiled modes' greedy tokens.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from gpt_fast.model import Attention
from gpt_fast.quant.kernels import resolve_kernel_choice

ATTENTION_KERNELS = ("auto", "triton", "torch")


def resolve_attention_kernel(kernel: str, device: torch.device) -> str:
    """``auto``: the PyTorch code, everywhere. On an H200 the fused kernel is faster than inductor's attention
    kernels alone for MHA (1.3× on the Llama-2-7B shape) but slower for GQA (0.5×), and the whole 7B decode step is
    slower with it (217.5 against 240.5 tok/s, BENCHMARKS.md, sixth session): it is there to be chosen and
    measured. Choosing Triton (a CUDA GPU with Triton installed, not ROCm) registers its operator
    (:func:`register_triton_ops`), before anything is compiled."""
    return resolve_kernel_choice(kernel, ATTENTION_KERNELS, "attention kernel", device, "torch", register_triton_ops)


@functools.cache
def register_triton_ops() -> None:
    """Register the kernel as the operator ``torch.ops.gpt_fast.decode_attention``, eagerly: ``torch.compile``
    cannot trace a registration (see :func:`gpt_fast.quant.kernels.register_triton_ops`). Nothing happens at
    import."""
    from torch.library import triton_op, wrap_triton

    from gpt_fast.kernels import triton_decode_attention

    @triton_op("gpt_fast::decode_attention", mutates_args=("kv",))
    def decode_attention(
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
        return triton_decode_attention.decode_attention(
            q, k, v, cos, sin, kv, input_pos, first_row, scale, softcap, window, wrap=wrap_triton
        )


def fused_decode_attention(*args: object) -> torch.Tensor:
    """What :class:`gpt_fast.model.Attention` calls as its ``decode_kernel``: the operator, with the arguments of
    :func:`gpt_fast.kernels.triton_decode_attention.decode_attention` (but ``launch`` and ``wrap``)."""
    return torch.ops.gpt_fast.decode_attention(*args)


def use_attention_kernel(model: nn.Module, kernel: str) -> None:
    """Give every attention layer of ``model`` the decode kernel ``kernel`` (a name :func:`resolve_attention_kernel`
    returned): ``triton``, the fused kernel; ``torch``, none (the model's PyTorch code)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.decode_kernel = fused_decode_attention if kernel == "triton" else None
