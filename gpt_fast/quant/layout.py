"""Which tensors a quantized checkpoint holds: their names, shapes and dtypes, and how many bytes they take.

A quantized linear layer ``P`` (``layers.0.attention.wqkv``, ...) stores, in place of ``P.weight`` in float:

- int8: ``P.weight`` int8 [out, in] and ``P.scales`` [out];
- int4: ``P.weight`` uint8 [out, in / 2] (two columns per byte) and ``P.scales``, ``P.zeros`` [out, groups].

Scales and zeros, like every tensor that is not quantized, are in the checkpoint's ``dtype``. With
``quantization.output`` the output projection is quantized too; for tied embeddings it is then stored apart
(``output.*``) while the embedding table stays as it is, for the lookup. With ``quantization.embeddings`` a tied
table is quantized in place instead: ``tok_embeddings.weight`` int8 [vocab, dim] and ``tok_embeddings.scales``
([vocab], or [vocab, groups] with a group size), one copy that the lookup and the output projection both read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import torch
from tqdm import tqdm

from gpt_fast.model.config import QUANTIZABLE_LINEAR, EmbeddingQuant, ModelConfig, QuantConfig
from gpt_fast.model.transformer import weight_count, weight_shapes
from gpt_fast.quant.schemes import n_groups, quantize_int4, quantize_int8

Shape = tuple[int, ...]
OUTPUT = "output"
TABLE = "tok_embeddings"  # the embedding table, quantized in place by quantization.embeddings
LAYER_KINDS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")  # each layer's projections
QUANTIZED_DTYPES = {"int8": torch.int8, "int4": torch.uint8}


def quantized_dtypes(quant: QuantConfig) -> tuple[torch.dtype, ...]:
    """The integer dtypes of the tensors a checkpoint quantized with ``quant`` holds."""
    modes = {quant.mode} | (set() if quant.embeddings is None else {quant.embeddings.mode})
    return tuple(QUANTIZED_DTYPES[mode] for mode in sorted(modes))


def quantized_linears(config: ModelConfig, quant: QuantConfig) -> dict[str, tuple[int, int]]:
    """``prefix -> (out_features, in_features)`` of every linear layer ``quant`` quantizes, in model order."""
    linears = {}
    for name, shape in weight_shapes(config).items():
        prefix = name.removesuffix(".weight")
        if prefix == name:  # a bias, or stacked experts (a parameter of its own)
            continue
        if prefix in quant.keep_float:
            continue
        if QUANTIZABLE_LINEAR.fullmatch(prefix) or (prefix == OUTPUT and quant.output):
            linears[prefix] = (shape[0], shape[1])
    if quant.output and config.tie_embeddings:
        linears[OUTPUT] = (config.vocab_size, config.dim)
    return linears


def quantized_tensors(
    out_features: int, in_features: int, quant: QuantConfig | EmbeddingQuant, dtype: torch.dtype
) -> dict:
    """``suffix -> (shape, dtype)`` of the tensors that stand for one quantized [out, in] weight."""
    groups = (out_features, n_groups(in_features, quant.group_size or in_features))
    if quant.mode == "int8":
        scales = groups if quant.group_size else (out_features,)
        return {"weight": ((out_features, in_features), torch.int8), "scales": (scales, dtype)}
    return {
        "weight": ((out_features, in_features // 2), torch.uint8),
        "scales": (groups, dtype),
        "zeros": (groups, dtype),
    }


def stored_specs(
    config: ModelConfig, quant: QuantConfig | None, dtype: torch.dtype
) -> dict[str, tuple[Shape, torch.dtype]]:
    """``name -> (shape, dtype)`` of every tensor a checkpoint of ``config`` holds."""
    specs = {name: (shape, dtype) for name, shape in weight_shapes(config).items()}
    if quant is None:
        return specs
    for prefix, (out_features, in_features) in quantized_linears(config, quant).items():
        specs.pop(f"{prefix}.weight", None)
        for suffix, spec in quantized_tensors(out_features, in_features, quant, dtype).items():
            specs[f"{prefix}.{suffix}"] = spec
    if quant.embeddings is not None:
        for suffix, spec in quantized_tensors(config.vocab_size, config.dim, quant.embeddings, dtype).items():
            specs[f"{TABLE}.{suffix}"] = spec
    return specs


def _bytes(specs: dict[str, tuple[Shape, torch.dtype]]) -> int:
    return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs.values())


def stored_size(config: ModelConfig, quant: QuantConfig | None, dtype: torch.dtype) -> tuple[int, int]:
    """``(tensors, bytes)`` a checkpoint of ``config`` holds, computed without listing every tensor (cheap however
    many layers the config claims; see :func:`gpt_fast.model.transformer.weight_count`)."""
    tensors, parameters = weight_count(config)
    size = parameters * dtype.itemsize
    if quant is None:
        return tensors, size
    extra_tensors = len(quantized_tensors(1, 2, quant, dtype)) - 1
    dim, inter, qkv = config.dim, config.intermediate_size, config.q_size + 2 * config.kv_size
    layer = [(qkv, dim), (dim, config.q_size), (2 * inter, dim), (dim, inter)]  # as LAYER_KINDS
    linears = [(shape, config.n_layer) for shape in layer]
    if quant.output:
        linears.append(((config.vocab_size, dim), 1))
        if config.tie_embeddings:  # stored apart: nothing of the embedding table is replaced
            tensors += 1
            size += config.vocab_size * dim * dtype.itemsize
    kept = Counter(QUANTIZABLE_LINEAR.fullmatch(name).group(2) for name in quant.keep_float)
    for (shape, count), kind in zip(linears, LAYER_KINDS + (OUTPUT,), strict=False):
        count -= kept[kind]
        quantized = _bytes(quantized_tensors(*shape, quant, dtype))
        size += count * (quantized - shape[0] * shape[1] * dtype.itemsize)
        tensors += count * extra_tensors
    if quant.embeddings is not None:
        table = quantized_tensors(config.vocab_size, config.dim, quant.embeddings, dtype)
        tensors += len(table) - 1
        size += _bytes(table) - config.vocab_size * config.dim * dtype.itemsize
    return tensors, size


def quantize_weight(
    weight: torch.Tensor, quant: QuantConfig | EmbeddingQuant, dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """``suffix -> tensor`` of one float [out, in] weight quantized on ``device``, scales and zeros in ``dtype``."""
    weight = weight.to(device)
    if quant.mode == "int8":
        return dict(zip(("weight", "scales"), quantize_int8(weight, dtype, quant.group_size), strict=True))
    return dict(zip(("weight", "scales", "zeros"), quantize_int4(weight, quant.group_size, dtype), strict=True))


TIED_SOURCE = "tok_embeddings.weight"  # what a tied output projection is quantized from


def quantize_state(
    state: Mapping[str, torch.Tensor],
    config: ModelConfig,
    quant: QuantConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    given: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of the quantized checkpoint from the float ``state`` of ``config``: each quantized layer's
    ``weight`` replaced by its quantized tensors (computed and left on ``device``), scales and zeros in ``dtype``;
    with ``quant.embeddings``, the embedding table too (:data:`TABLE`). The layers in ``given`` (``prefix ->
    {suffix: tensor}``) are taken from there as they are (their scales and zeros cast to ``dtype``): a source
    quantized in this scheme already (:mod:`gpt_fast.convert.gguf_quant`), or layers rounded by GPTQ
    (:mod:`gpt_fast.quant.calibrate`)."""
    out = dict(state)
    given = given or {}
    schemes: dict[str, QuantConfig | EmbeddingQuant] = dict.fromkeys(quantized_linears(config, quant), quant)
    if quant.embeddings is not None:
        schemes[TABLE] = quant.embeddings
    for prefix, scheme in tqdm(schemes.items(), desc=f"Quantizing ({quant.name})", unit="layer"):
        name = f"{prefix}.weight"
        if prefix in given:
            parts = {suffix: t if suffix == "weight" else t.to(dtype) for suffix, t in given[prefix].items()}
        else:
            parts = quantize_weight(
                state[TIED_SOURCE if prefix == OUTPUT and config.tie_embeddings else name], scheme, dtype, device
            )
        out.pop(name, None)
        out.update({f"{prefix}.{suffix}": tensor for suffix, tensor in parts.items()})
    return out
