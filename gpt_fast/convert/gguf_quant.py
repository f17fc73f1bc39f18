"""GGUF 4-bit blocks taken over as our int4 scheme, and a tied embedding table's 8-bit ones as our grouped int8,
without a round trip through float.

llama.cpp's ``Q4_0`` and ``Q4_1`` hold each row in blocks of 32 values: an f16 scale ``d`` (and, for ``Q4_1``,
an f16 offset ``m``) and 32 levels ``q`` in 0..15, the value being ``d * (q - 8)`` (``Q4_0``) or ``d * q + m``
(``Q4_1``). Our int4 with groups of 32 (:mod:`gpt_fast.quant.schemes`: ``(q - 8) * scale + zero``) holds the same
numbers with ``scale = d`` and ``zero = 0`` or ``m + 8 d``: the same levels, no second rounding, and no search
for each group's range (dequantizing and quantizing again finds the same grid only where a block spans its full
range of levels).

``Q8_0`` holds blocks of 32 values as an f16 scale ``d`` and 32 int8 ``q``, the value being ``d * q``: a tied
embedding table stored so is our int8 in groups of 32 (``quantization.embeddings``, scale ``d``, the same ``q``).
Our per-row int8 cannot hold it, so the projections of a layer in ``Q8_0`` are dequantized and quantized like any
float weight, and so are the K-quants, which keep 6-bit sub-block scales that would need their own decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType

from gpt_fast.convert.layout import hf_layout
from gpt_fast.model.config import ModelConfig, QuantConfig
from gpt_fast.quant.layout import TABLE
from gpt_fast.quant.schemes import INT4_MID, pack_int4

BLOCK = 32  # values per Q4_0 / Q4_1 block: the group size they map to
# type -> bytes of f16 numbers before the 16 bytes of levels in a block (d; d and m)
BLOCK_HEADERS = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4}
Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # levels uint8 [N, K], scales and zeros float32 [N, K/32]


def maps_exactly(quant: QuantConfig | None) -> bool:
    """Whether ``quant`` is the scheme GGUF 4-bit blocks map to."""
    return quant is not None and quant.mode == "int4" and quant.group_size == BLOCK


def table_maps_exactly(quant: QuantConfig | None) -> bool:
    """Whether ``quant`` stores a tied embedding table as GGUF ``Q8_0`` blocks map to: int8 in groups of 32."""
    table = None if quant is None else quant.embeddings
    return table is not None and table.mode == "int8" and table.group_size == BLOCK


def f16_scales(blocks: np.ndarray, start: int) -> torch.Tensor:
    """The f16 numbers at byte ``start`` of each block of ``blocks`` uint8 [N, G, bytes per block], as float32
    [N, G]."""
    return torch.from_numpy(blocks[:, :, start : start + 2].copy().view(np.float16)[..., 0].astype(np.float32))


def int8_blocks(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """One Q8_0 tensor's raw blocks, uint8 [N, bytes per row], as int8 values [N, K] and scales float32 [N, K/32]."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, 2 + BLOCK)  # [N, G, bytes per block]
    q = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8)).reshape(rows, -1)
    return q, f16_scales(blocks, 0)


def exact_table_parts(
    tensors: Iterable[tuple[str, GGMLQuantizationType, np.ndarray]], config: ModelConfig, quant: QuantConfig
) -> dict[str, dict[str, torch.Tensor]]:
    """``{TABLE: {"weight", "scales"}}`` (scales float32) where ``quant`` stores the tied embedding table as int8
    in groups of 32 and the file holds it as ``Q8_0``, from ``(HF name, type, raw blocks)``; else nothing (the
    table is quantized from its float values)."""
    if not table_maps_exactly(quant):
        return {}
    ((source, _),) = hf_layout(config)[f"{TABLE}.weight"]
    for hf_name, qtype, data in tensors:
        if hf_name == source and qtype == GGMLQuantizationType.Q8_0:
            q, scales = int8_blocks(data)
            return {TABLE: {"weight": q, "scales": scales}}
    return {}


def int4_blocks(data: np.ndarray, qtype: GGMLQuantizationType) -> Parts:
    """One Q4_0 / Q4_1 tensor's raw blocks, uint8 [N, bytes per row], as levels, scales and zeros."""
    header = BLOCK_HEADERS[qtype]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, header + BLOCK // 2)  # [N, G, bytes per block]
    d = f16_scales(blocks, 0)  # [N, G]
    packed = torch.from_numpy(blocks[:, :, header:].copy())  # [N, G, 16]: value j low nibble, j + 16 high
    levels = torch.cat([packed & 0xF, packed >> 4], dim=2).reshape(rows, -1)  # [N, K]
    if qtype == GGMLQuantizationType.Q4_0:
        return levels, d, torch.zeros_like(d)
    m = f16_scales(blocks, 2)
    return levels, d, m + INT4_MID * d


def exact_int4_parts(
    tensors: Iterable[tuple[str, GGMLQuantizationType, np.ndarray]],
    config: ModelConfig,
    quant: QuantConfig,
    unpermute: Callable[[str, torch.Tensor], torch.Tensor],
) -> dict[str, dict[str, torch.Tensor]]:
    """``prefix -> {"weight", "scales", "zeros"}`` (scales and zeros float32) of each quantized layer whose every
    source tensor is ``Q4_0`` or ``Q4_1``, from ``(HF name, type, raw blocks)``; ``unpermute`` puts a tensor's
    rows in our order, as the converter does for float tensors (row operations, so levels, scales and zeros alike).
    Fused layers are joined along their rows, as :func:`gpt_fast.convert.layout.fuse_tensors` joins weights."""
    if not maps_exactly(quant):
        return {}
    layout = hf_layout(config)  # GGUF files hold llama's tensors, named as Hugging Face's llama
    ours = {hf: name for name, parts in layout.items() for hf, _ in parts}
    pending: dict[str, dict[str, Parts]] = {}
    for hf_name, qtype, data in tensors:
        name = ours.get(hf_name, "")
        if qtype not in BLOCK_HEADERS or not name.startswith("layers."):  # not the embedding table nor the output
            continue
        pending.setdefault(name, {})[hf_name] = tuple(unpermute(hf_name, t) for t in int4_blocks(data, qtype))
    out = {}
    for name, parts in pending.items():
        order = [hf for hf, _ in layout[name]]
        if set(parts) != set(order):  # a part of another type: the layer is quantized from float
            continue
        levels, scales, zeros = (torch.cat([parts[hf][i] for hf in order]) for i in range(3))
        out[name.removesuffix(".weight")] = {"weight": pack_int4(levels), "scales": scales, "zeros": zeros}
    return out
