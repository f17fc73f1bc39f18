"""A gated MLP's hidden state in a decode step, ``act(gate) * up``, as a kernel of its own or inside the next GEMV.

- ``torch``: the model's code (:func:`gpt_fast.model.transformer.gated`). Inductor then computes the hidden state
  inside the ``w2`` GEMV, once for every block of its output rows, from ``w13``'s output kept in float32: on the
  Llama-2-7B shape each decode step's ``w2`` re-reads 88 KB per block, and coordinate-descent tuning of that kernel
  lands on blocks that run at 29-57 µs in the model, where the same GEMV over a ready hidden state runs at 24-29 µs.
- ``triton``: :mod:`gpt_fast.kernels.triton_gated_activation`, one small kernel per layer writing the hidden state
  once, wrapped as the ``torch.library.triton_op`` ``gpt_fast::gated_activation`` so that inductor cannot fold it
  into the GEMV. On an H200 the 7B shape decodes 246.7 tok/s with an equivalent operator against 230.7 without
  (docs/bench/HISTORY.md, 2026-11-23e). For small models the evidence is mixed (the SmolLM2-135M shape's MLP alone:
  6.9 µs with it, 6.0 without; its whole decode, one run each: 1168 tok/s with it, 1108 without), so ``auto`` keeps
  their code.

The model calls the kernel only in compiled decode steps (one position per row); eager steps and prefills keep the
PyTorch code. Where ``--linear_kernel`` is ``triton``, a step of one row computes the hidden state inside ``w13``'s
GEMV instead (:meth:`gpt_fast.accel.linear.FusedRow.gated`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from gpt_fast.accel.choice import choose
from gpt_fast.accel.options import ACTIVATION_KERNELS
from gpt_fast.kernels.available import triton_usable
from gpt_fast.model.config import ModelConfig
from gpt_fast.model.transformer import FeedForward

# ``auto`` takes the kernel for w2 matrices of at least this many weights (Llama-2-7B's has 45M, SmolLM2-135M's 0.9M;
# sizes between are not measured)
LARGE_FFN = 2**24


def resolve_activation_kernel(kernel: str, device: torch.device, config: ModelConfig) -> str:
    """``auto``: Triton on a CUDA GPU with Triton installed (not ROCm) for a model whose ``w2`` has at least
    :data:`LARGE_FFN` weights, else the PyTorch code. Choosing Triton registers its operator
    (:func:`register_triton_ops`), before anything is compiled."""
    auto = "triton" if large_mlp(config) and triton_usable(device) else "torch"
    return choose(kernel, ACTIVATION_KERNELS, "activation kernel", device, auto, register_triton_ops)


def large_mlp(config: ModelConfig) -> bool:
    """Whether the model's ``w2`` has at least :data:`LARGE_FFN` weights: where ``auto`` takes our decode kernels."""
    return config.dim * config.intermediate_size >= LARGE_FFN


@functools.cache
def register_triton_ops() -> None:
    """Register the kernel as the operator ``torch.ops.gpt_fast.gated_activation``, eagerly: ``torch.compile``
    cannot trace a registration (see :func:`gpt_fast.quant.products.register_triton_ops`). Nothing happens at
    import."""
    from torch.library import triton_op, wrap_triton

    from gpt_fast.kernels import triton_gated_activation

    @triton_op("gpt_fast::gated_activation", mutates_args=())
    def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        return triton_gated_activation.gated_activation(gate_up, activation, wrap=wrap_triton)


def fused_gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """What :class:`gpt_fast.model.transformer.FeedForward` calls as its ``activation_kernel``: the operator."""
    return torch.ops.gpt_fast.gated_activation(gate_up, activation)


def use_activation_kernel(model: nn.Module, kernel: str) -> None:
    """Give every gated MLP of ``model`` the activation kernel ``kernel`` (a name :func:`resolve_activation_kernel`
    returned): ``triton``, the kernel; ``torch``, none (the model's PyTorch code)."""
    for module in model.modules():
        if isinstance(module, FeedForward):
            module.activation_kernel = fused_gated_activation if kernel == "triton" else None
