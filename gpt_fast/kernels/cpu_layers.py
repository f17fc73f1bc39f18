"""Every decoder layer of a one-token decode step of one sequence on an x86 CPU as one C++ operator,
``torch.ops.gpt_fast.decode_layers_cpu`` (``cpu_layers.cpp``, built into the library of
:mod:`gpt_fast.kernels.cpu_gemv`): the norms, residual adds and gated activations in C++, the products those of
``cpu_gemv.cpp`` (float32 weights through torch's own product) and the attention ``cpu_attention.cpp``'s, called
directly, with no Python or inductor wrapper between them.

A product's weight is described by its kind (:data:`KINDS`), its group size (0: a scale per row) and whether a bias
follows its tensors.
"""

from __future__ import annotations

import torch

# a weight's kind and the tensors it is given as, in order (cpu_gemv.cpp, layer_product)
KINDS = {
    "float32": 0,  # weight [N, K]
    "int8": 1,  # weight [N, K] int8, scales [N] or [N, K / group] (int8_gemv_cpu, int8_group_gemv_cpu)
    "int8-q8": 2,  # the same, the row rounded to int8 per 32 columns (int8_q8_gemv_cpu)
    "int4": 3,  # weight [N, K / 2] uint8, scales and zeros [N, K / group] (int4_gemv_cpu)
    "int4-q8": 4,  # the same, the row rounded (int4_q8_gemv_cpu)
}


def decode_layers(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    plan: list[int],
    kv: list[torch.Tensor],
    cos: torch.Tensor,
    sin: torch.Tensor,
    input_pos: torch.Tensor,
    shape: list[int],
    eps: float,
    offset: float,
    scale: float,
    softcap: float | None,
    gelu: bool,
) -> torch.Tensor:
    """The residual stream ``x`` [1, 1, dim] (float32) through every layer for the token at ``input_pos`` [1]:
    ``weights`` holds each layer's attention and MLP norm weights, then the tensors of its wqkv, wo, w13 and w2
    (and a bias after a product's tensors where it has one), as ``plan`` says, three numbers a product (kind, group
    size, bias); ``kv`` each layer's static cache [2, 1, H_kv, S, D] (written at the position); ``cos`` and ``sin``
    the model's rotary tables [positions, D / 2]; ``shape`` the heads, kv heads and head size; ``gelu``: GeGLU
    (tanh) rather than SwiGLU. The caller loads the library first
    (:func:`gpt_fast.kernels.cpu_gemv.load_cpu_kernels`)."""
    return torch.ops.gpt_fast.decode_layers_cpu(
        x, weights, plan, kv, cos, sin, input_pos, shape, eps, offset, scale, softcap, gelu
    )
