"""gemlite's A16W8 Triton kernels (the optional ``gemlite`` package, ``pip install 'gpt-fast[gemlite]'``) for the
products of a batched decode step with int8 weights: 16-bit activation rows [M, K] times int8 weights [N, K] with a
scale per output channel. On an H200 they take 4 to 64 rows in 0.50 to 0.87 times our Triton matrix product's time,
while our GEMV stays the faster one for one to three rows (docs/bench/HISTORY.md, 2026-11-29, "Quantized products beside
gemlite"). gemlite keeps its own copy of the weights, transposed; its kernels tune themselves on the first call for
each number of rows (Triton's autotuning), which an engine's warm-up step does before any CUDA graph is recorded."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch


def gemlite_importable() -> bool:
    """Whether the ``gemlite`` package is installed (nothing is imported)."""
    return importlib.util.find_spec("gemlite") is not None


@dataclass(frozen=True)
class GemliteWeights:
    """The tensors and the integer settings that gemlite's operator ``gemlite::forward_functional`` takes for one
    weight matrix (a plain list, so that a module holding them counts no extra parameters)."""

    tensors: list[torch.Tensor]
    meta: list[int]


def gemlite_int8_weights(weight: torch.Tensor, scales: torch.Tensor) -> GemliteWeights:
    """gemlite's layout of the int8 ``weight`` [N, K] with ``scales`` [N] (float16 or bfloat16, the activations'
    dtype), on ``weight``'s CUDA device."""
    from gemlite.helper import A16W8_INT8

    layer = A16W8_INT8(device=weight.device, dtype=scales.dtype).from_weights(weight, scales=scales[:, None])
    return GemliteWeights(layer.get_tensor_args(), layer.get_meta_args())


def gemlite_int8_product(rows: torch.Tensor, weights: GemliteWeights) -> torch.Tensor:
    """``rows`` [M, K] times the weights of :func:`gemlite_int8_weights`: [M, N] in ``rows``' dtype."""
    return torch.ops.gemlite.forward_functional(rows, None, weights.tensors, weights.meta)
