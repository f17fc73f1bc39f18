"""Every decoder layer of a decode step of one token per row on an x86 CPU as one C++ operator,
``torch.ops.gpt_fast.decode_layers_cpu`` (``cpu_layers.cpp``, built into the library of
:mod:`gpt_fast.kernels.cpu_gemv`): the norms, residual adds and gated activations in C++, the products those of
``cpu_gemv.cpp`` (float32 weights too: float_gemv) and the attention ``cpu_attention.cpp``'s, called
directly, with no Python or inductor wrapper between them. A step of several rows (a server's) reads each weight
once for all of them; each row attends at its own position, in a static or a paged cache.

A product's weight is described by its kind (:data:`KINDS`), its group size (0: a scale per row) and whether a bias
follows its tensors. A plan may end with one product more, the output projection (after the final norm's weight in
the tensors): the operator then returns the logits.
"""

from __future__ import annotations

import torch

from gpt_fast.kernels import cpu_gemv

# a weight's kind and the tensors it is given as, in order (cpu_gemv.cpp, layer_product)
KINDS = {
    "float32": 0,  # weight [N, K]
    "int8": 1,  # weight [N, K] int8, scales [N] or [N, K / group] (int8_gemv_cpu, int8_group_gemv_cpu)
    "int8-q8": 2,  # words [N / 16, K * 16], scales [N / 16, groups, 16] (pack_int8_q8), rows rounded (int8_q8_gemv_cpu)
    "int4": 3,  # weight [N, K / 2] uint8, scales and zeros [N, K / group] (int4_gemv_cpu)
    "int4-q8": 4,  # words [N / 16, K * 8], scales and zeros [N / 16, K / group, 16] (pack_int4_q8, int4_q8_gemv_cpu)
}
TENSORS = (1, 2, 2, 3, 3)  # a weight's tensors by kind, as KINDS numbers them
PACKED = (2, 4)  # the kinds whose first tensor has a row per 16 outputs (cpu_gemv.Q8_ROWS)
PLAN_FIELDS = 3  # a product's plan: its kind, group size, bias (1) or not (0)
LAYER_PRODUCTS = 4  # wqkv, wo, w13, w2


def holds_head(plan: list[int], layers: int) -> bool:
    """Whether ``plan`` holds the output projection after ``layers`` layers' products (the operator returns logits)."""
    return len(plan) == (layers * LAYER_PRODUCTS + 1) * PLAN_FIELDS


def output_shape(x: torch.Tensor, weights: list[torch.Tensor], plan: list[int], layers: int) -> list[int]:
    """The shape :func:`decode_layers` returns: ``x``'s [R, 1, dim], or [R, 1, V] where the plan holds the head."""
    if not holds_head(plan, layers):
        return list(x.shape)
    kind, _, bias = plan[-PLAN_FIELDS:]
    head = weights[len(weights) - TENSORS[kind] - bias]  # [V, ...], or [V / 16, ...] for the packed kinds
    return [*x.shape[:-1], head.shape[0] * (cpu_gemv.Q8_ROWS if kind in PACKED else 1)]


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
    first_row: int = 0,
    table: torch.Tensor | None = None,
    gemv_rows: list[int] | None = None,
) -> torch.Tensor:
    """The residual stream ``x`` [R, 1, dim] (float32) of R rows through every layer for their tokens at
    ``input_pos`` ([1]: every row's, or [R, 1]: each row's own): ``weights`` holds each layer's attention and MLP
    norm weights, then the tensors of its wqkv, wo, w13 and w2 (and a bias after a product's tensors where it has
    one), as ``plan`` says, three numbers a product (kind, group size, bias), and where the plan holds a product more
    (:func:`holds_head`) the final norm's weight and the output projection's tensors, which make the result the
    logits [R, 1, V]; ``kv`` each layer's cache, whose rows ``first_row`` onwards are the step's (written at their
    positions): static [2, rows, H_kv, S, D], or given the block table ``table`` [rows, W] (int64), paged
    [2, N, block_size, H_kv, D]; ``cos`` and ``sin`` the model's rotary tables [positions, D / 2]; ``shape`` the
    heads, kv heads and head size; ``gelu``: GeGLU (tanh) rather than SwiGLU; ``gemv_rows``, by kind (:data:`KINDS`),
    the most rows a quantized product takes one weight row at a time before it is a matrix product (None: any). The
    caller loads the library first (:func:`gpt_fast.kernels.cpu_gemv.load_cpu_kernels`)."""
    return torch.ops.gpt_fast.decode_layers_cpu(
        x, weights, plan, kv, cos, sin, input_pos, shape, eps, offset, scale, softcap, gelu, first_row, table,
        gemv_rows or [],
    )  # fmt: skip
