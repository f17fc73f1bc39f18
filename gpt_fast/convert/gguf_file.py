"""GGUF file (llama.cpp's llama, qwen2 and qwen3 architectures) -> gpt-fast checkpoint, read with the maintained
``gguf`` library.

Tensor names are mapped onto the Hugging Face names and go through the same checks and fusion as an HF folder.
Quantized tensors are dequantized to float32. For the llama architecture only, llama.cpp's converter stores the q
and k projections with each head's rotary halves interleaved; they are put back in the Hugging Face layout our
rotary embedding uses. Its qwen2 and qwen3 converters keep Hugging Face's layout.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from gpt_fast.checkpoint.load import check_tokenizer_size
from gpt_fast.convert.gguf_header import check_gguf_header
from gpt_fast.convert.gguf_quant import exact_int4_parts, exact_table_parts
from gpt_fast.convert.gguf_tokenizer import check_tokenizer_metadata, tokenizer_from_gguf
from gpt_fast.convert.layout import check_tensors, fuse_tensors
from gpt_fast.convert.tokenizer_common import check_template_bounds
from gpt_fast.convert.weight_files import TensorInfo
from gpt_fast.convert.writer import check_checkpoint_output, write_checkpoint
from gpt_fast.model.config import CheckpointConfig, GenerationDefaults, ModelConfig, QuantConfig, RopeScaling
from gpt_fast.quant.layout import quantize_state
from gpt_fast.util.device import dtype_name, parse_dtype
from gpt_fast.util.fileio import first_line, regular_file

GGUF_TO_HF = [
    (re.compile(r"token_embd\.weight"), "model.embed_tokens.weight"),
    (re.compile(r"blk\.(\d+)\.attn_(q|k|v)\.(weight|bias)"), "model.layers.{0}.self_attn.{1}_proj.{2}"),
    (re.compile(r"blk\.(\d+)\.attn_(q|k)_norm\.weight"), "model.layers.{0}.self_attn.{1}_norm.weight"),
    (re.compile(r"blk\.(\d+)\.attn_output\.weight"), "model.layers.{0}.self_attn.o_proj.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.weight"), "model.layers.{0}.mlp.{1}_proj.weight"),
    (re.compile(r"blk\.(\d+)\.attn_norm\.weight"), "model.layers.{0}.input_layernorm.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_norm\.weight"), "model.layers.{0}.post_attention_layernorm.weight"),
    (re.compile(r"output_norm\.weight"), "model.norm.weight"),
    (re.compile(r"output\.weight"), "lm_head.weight"),
]


@dataclass(frozen=True)
class GgufFamily:
    """What a GGUF architecture implies beyond its metadata (our model never sees the name, only these)."""

    permuted: bool = False  # q/k rows with each head's rotary halves interleaved (llama.cpp does so for llama only)
    implies: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields the architecture fixes


# general.architecture values this converter reads exactly (llama.cpp's names, as the gguf library spells them)
GGUF_FAMILIES = {
    "llama": GgufFamily(permuted=True),  # Llama 2/3/3.1/3.2, Mistral 7B, SmolLM/SmolLM2, TinyLlama
    "qwen2": GgufFamily(implies={"qkv_bias": True}),  # Qwen2, Qwen2.5
    "qwen3": GgufFamily(implies={"qk_norm": True}),  # Qwen3 dense
}
TOKENS_KEY = "tokenizer.ggml.tokens"
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 GGUFs store the divisors of the rotary frequencies as a tensor
PLAIN_DTYPES = {
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
    GGMLQuantizationType.F32: torch.float32,
}


INTEGER_TYPES = {
    GGMLQuantizationType.I8,
    GGMLQuantizationType.I16,
    GGMLQuantizationType.I32,
    GGMLQuantizationType.I64,
}
_REQUIRED = object()
# The kinds of metadata value a key may be asked to hold, named as the error message says them.
INT, NUMBER, STR = "a positive integer", "a finite number", "a string"
_INT_VALUES = {
    GGUFValueType.UINT8,
    GGUFValueType.INT8,
    GGUFValueType.UINT16,
    GGUFValueType.INT16,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT64,
}
_VALUE_TYPES = {
    INT: _INT_VALUES,
    NUMBER: _INT_VALUES | {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64},
    STR: {GGUFValueType.STRING},
}


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader, once its header has been checked to be bounded (see :mod:`gguf_header`)."""
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    regular_file(path, "GGUF file")
    check_gguf_header(path)
    try:
        return GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError, struct.error, TypeError) as err:
        raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated): {first_line(err)}") from None


def metadata(reader: GGUFReader, key: str, kind: str, default: Any = _REQUIRED) -> Any:
    """A single metadata value of ``kind``; absent, ``default`` (an error without one)."""
    field = reader.get_field(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata lacks {key}")
        return default
    value = field.contents() if field.types[:1] and field.types[0] in _VALUE_TYPES[kind] else None
    if value is None or (kind == INT and value <= 0) or (kind == NUMBER and not math.isfinite(value)):
        types = "/".join(t.name for t in field.types)
        raise ValueError(f"GGUF metadata {key} has the wrong type or value ({types}; it must be {kind})")
    return value


def find_tensor(reader: GGUFReader, name: str) -> Any:
    return next((t for t in reader.tensors if t.name == name), None)


def tensor_data(tensor: Any) -> torch.Tensor:
    """A GGUF tensor as a torch tensor in PyTorch's [out, in] layout (float32 if it was quantized)."""
    shape = tuple(reversed([int(n) for n in tensor.shape]))
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except (NotImplementedError, ValueError) as err:
        raise ValueError(f"tensor {tensor.name}: cannot dequantize {tensor.tensor_type.name} ({err})") from None
    data = torch.from_numpy(np.array(array, order="C"))  # a copy: the reader's arrays map the file read-only
    return data.reshape(shape).to(PLAIN_DTYPES.get(tensor.tensor_type, torch.float32))


def rope_scaling(reader: GGUFReader, arch: str) -> RopeScaling | None:
    freqs = find_tensor(reader, ROPE_FREQS)
    if freqs is not None:
        return RopeScaling(kind="divisors", divisors=tuple(tensor_data(freqs).float().ravel().tolist()))
    kind = metadata(reader, f"{arch}.rope.scaling.type", STR, "none")
    if kind == "none":
        return None
    if kind != "linear":
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, rope_freqs)")
    return RopeScaling(kind="linear", factor=float(metadata(reader, f"{arch}.rope.scaling.factor", NUMBER)))


def architecture(reader: GGUFReader) -> str:
    """The file's ``general.architecture``, one of :data:`GGUF_FAMILIES`."""
    arch = metadata(reader, "general.architecture", STR)
    if arch not in GGUF_FAMILIES:
        raise ValueError(f"unsupported architecture {arch} (supported: {', '.join(GGUF_FAMILIES)})")
    return arch


def model_config_from_gguf(reader: GGUFReader) -> ModelConfig:
    arch = architecture(reader)
    embedding = find_tensor(reader, "token_embd.weight")
    if embedding is None:
        raise ValueError("no token_embd.weight tensor")
    dim = metadata(reader, f"{arch}.embedding_length", INT)
    n_head = metadata(reader, f"{arch}.attention.head_count", INT)
    head_dim = metadata(reader, f"{arch}.attention.key_length", INT, dim // n_head)
    if metadata(reader, f"{arch}.attention.value_length", INT, head_dim) != head_dim:
        raise ValueError(f"unsupported {arch}.attention.value_length different from its key_length")
    return ModelConfig(
        block_size=metadata(reader, f"{arch}.context_length", INT),
        vocab_size=metadata(reader, f"{arch}.vocab_size", INT, int(embedding.shape[-1])),
        n_layer=metadata(reader, f"{arch}.block_count", INT),
        n_head=n_head,
        dim=dim,
        intermediate_size=metadata(reader, f"{arch}.feed_forward_length", INT),
        n_local_heads=metadata(reader, f"{arch}.attention.head_count_kv", INT, n_head),
        head_dim=head_dim,
        rope_base=float(metadata(reader, f"{arch}.rope.freq_base", NUMBER, 10000.0)),
        norm_eps=float(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon", NUMBER)),
        tie_embeddings=find_tensor(reader, "output.weight") is None,
        rope_scaling=rope_scaling(reader, arch),
        **GGUF_FAMILIES[arch].implies,
    )


def hf_name(name: str) -> str:
    """The HF name of a GGUF tensor (unknown names are returned unchanged, to be reported as unexpected)."""
    for pattern, target in GGUF_TO_HF:
        match = pattern.fullmatch(name)
        if match:
            return target.format(*match.groups())
    return name


def tensor_infos(reader: GGUFReader, src: Path) -> dict[str, TensorInfo]:
    integer = next((t for t in reader.tensors if t.tensor_type in INTEGER_TYPES), None)
    if integer is not None:
        raise ValueError(f"{src}: tensor {integer.name} has integer type {integer.tensor_type.name}")
    return {
        hf_name(t.name): TensorInfo(
            tuple(reversed([int(n) for n in t.shape])), PLAIN_DTYPES.get(t.tensor_type, torch.float32), src
        )
        for t in reader.tensors
    }


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of rotary halves in a q or k projection [n_heads * D, dim]."""
    return weight.reshape(n_heads, weight.shape[0] // n_heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def hf_order(config: ModelConfig, arch: str) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """The rows of the tensor of an HF name put in Hugging Face's order (q and k projections un-interleaved where
    llama.cpp interleaved them)."""

    def reorder(name: str, data: torch.Tensor) -> torch.Tensor:
        if not GGUF_FAMILIES[arch].permuted:
            return data
        if name.endswith("q_proj.weight"):
            return unpermute_rotary(data, config.n_head)
        if name.endswith("k_proj.weight"):
            return unpermute_rotary(data, config.n_local_heads)
        return data

    return reorder


def hf_tensors(reader: GGUFReader, config: ModelConfig, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    reorder = hf_order(config, arch)
    for t in reader.tensors:
        name = hf_name(t.name)
        yield name, reorder(name, tensor_data(t))


def source_dtype(reader: GGUFReader) -> torch.dtype:
    """float16 or bfloat16 when every matrix is stored so; float32 otherwise (quantized tensors dequantize to it)."""
    kinds = {PLAIN_DTYPES.get(t.tensor_type, torch.float32) for t in reader.tensors if len(t.shape) == 2}
    return kinds.pop() if len(kinds) == 1 else torch.float32


def convert_gguf(
    src: Path,
    out_dir: Path,
    dtype: str | None = None,
    quantization: QuantConfig | None = None,
    generation: GenerationDefaults | None = None,
) -> Path:
    """Convert a GGUF file of a supported architecture into ``out_dir`` (quantized with ``quantization``, with the
    recommended sampling ``generation`` recorded); return the path of the written ``model.pth``."""
    check_checkpoint_output(out_dir)
    reader = open_gguf(src)
    try:
        model = model_config_from_gguf(reader)
        check_tokenizer_metadata(reader)
        check_template_bounds(metadata(reader, CHAT_TEMPLATE_KEY, STR, None), f"GGUF metadata {CHAT_TEMPLATE_KEY}")
        if quantization is not None:
            quantization.check_model(model)
    except ValueError as err:
        raise ValueError(f"{src}: {err}") from None
    tokens = reader.get_field(TOKENS_KEY)
    if tokens is not None:
        check_tokenizer_size(len(tokens.data), model, f"{src}: {TOKENS_KEY}")
    check_tensors(tensor_infos(reader, src), model, src)
    target = parse_dtype(dtype) if dtype else source_dtype(reader)
    arch = architecture(reader)
    state = fuse_tensors(hf_tensors(reader, model, arch), model, target, src)
    if quantization is not None:
        raw = [(hf_name(t.name), t.tensor_type, t.data) for t in reader.tensors]
        exact = exact_int4_parts(raw, model, quantization, hf_order(model, arch))
        exact |= exact_table_parts(raw, model, quantization)
        state = quantize_state(state, model, quantization, target, given=exact)

    def prepare(stage: Path) -> CheckpointConfig:
        try:
            tok_config, chat_template = tokenizer_from_gguf(reader, stage)
        except ValueError as err:
            raise ValueError(f"{src}: {err}") from None
        return CheckpointConfig(
            model=model,
            tokenizer=tok_config,
            dtype=dtype_name(target),
            chat_template=chat_template,
            source={
                "kind": "gguf",
                "path": str(src),
                "name": metadata(reader, "general.name", STR, ""),
                "architecture": arch,
            },
            quantization=quantization,
            generation=generation,
        )

    return out_dir / write_checkpoint(out_dir, state, prepare).weights
