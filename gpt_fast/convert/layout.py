"""Our weight layout, from Hugging Face Llama tensor names (the GGUF converter maps its names onto these too).

Tensors arrive one at a time; q/k/v and gate/up are stacked into the fused ``wqkv`` and ``w13`` matrices our
model uses as soon as a group is complete, so peak memory is the output plus one group.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm import tqdm

from gpt_fast.checkpoint import check_finite, check_shapes, check_tensor_count
from gpt_fast.config import ModelConfig
from gpt_fast.convert.weight_files import TensorInfo
from gpt_fast.device import DTYPES

# HF tensor name pattern -> (our name, part of a fused tensor or None)
NAME_MAP = [
    (re.compile(r"model\.embed_tokens\.weight"), "tok_embeddings.weight", None),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.weight"), "layers.{0}.attention.wqkv.weight", 2),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight"), "layers.{0}.attention.wo.weight", None),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight"), "layers.{0}.feed_forward.w13.weight", 2),
    (re.compile(r"model\.layers\.(\d+)\.mlp\.down_proj\.weight"), "layers.{0}.feed_forward.w2.weight", None),
    (re.compile(r"model\.layers\.(\d+)\.input_layernorm\.weight"), "layers.{0}.attention_norm.weight", None),
    (re.compile(r"model\.layers\.(\d+)\.post_attention_layernorm\.weight"), "layers.{0}.ffn_norm.weight", None),
    (re.compile(r"model\.norm\.weight"), "norm.weight", None),
    (re.compile(r"lm_head\.weight"), "output.weight", None),
]
IGNORED = re.compile(
    r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|rope_freqs\.weight"
)  # buffers some checkpoints hold
FUSED_PARTS = {"wqkv": ("q", "k", "v"), "w13": ("gate", "up")}


def hf_weight_count(config: ModelConfig) -> int:
    """How many tensors :func:`hf_weight_shapes` lists, computed without listing them."""
    return 9 * config.n_layer + (2 if config.tie_embeddings else 3)


def max_source_tensors(config: ModelConfig) -> int:
    """The most tensors a source of this shape may hold: its weights, a copy of a tied output projection, and the
    buffers some checkpoints keep (one rotary table per layer, one rope_freqs)."""
    return hf_weight_count(config) + config.n_layer + 2


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-family HF checkpoint of this shape holds, with its shape."""
    dim, inter = config.dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, dim), "model.norm.weight": (dim,)}
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, dim)
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (config.q_size, dim),
            p + "self_attn.k_proj.weight": (config.kv_size, dim),
            p + "self_attn.v_proj.weight": (config.kv_size, dim),
            p + "self_attn.o_proj.weight": (dim, config.q_size),
            p + "mlp.gate_proj.weight": (inter, dim),
            p + "mlp.up_proj.weight": (inter, dim),
            p + "mlp.down_proj.weight": (dim, inter),
            p + "input_layernorm.weight": (dim,),
            p + "post_attention_layernorm.weight": (dim,),
        }
    return shapes


def check_tensors(infos: dict[str, TensorInfo], config: ModelConfig, src: Path) -> None:
    """Missing and unexpected names (all of them), then the first shape that disagrees with config.json."""
    present = {n: info.shape for n, info in infos.items() if not IGNORED.fullmatch(n)}
    if config.tie_embeddings:
        present.pop("lm_head.weight", None)  # tied: a saved copy of the embedding table is redundant
    check_tensor_count(len(present), hf_weight_count(config), config, str(src))
    check_shapes(present, hf_weight_shapes(config), str(src))


def source_dtype(infos: dict[str, TensorInfo]) -> torch.dtype:
    """The dtype holding most of the parameters (float32 for float64 sources)."""
    counts: Counter[torch.dtype] = Counter()
    for info in infos.values():
        counts[info.dtype] += max(1, torch.Size(info.shape).numel())
    dtype = counts.most_common(1)[0][0]
    return dtype if dtype in DTYPES.values() else torch.float32


def our_name(hf_name: str) -> tuple[str, str | None]:
    for pattern, target, part_group in NAME_MAP:
        match = pattern.fullmatch(hf_name)
        if match:
            return target.format(*match.groups()), match.group(part_group) if part_group else None
    raise AssertionError(f"unmapped tensor {hf_name} passed the name check")


def fuse_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, dtype: torch.dtype, src: Path
) -> dict[str, torch.Tensor]:
    """Our state dict from (HF name, tensor) pairs already checked by :func:`check_tensors`; NaN and infinite
    values (in the source, or made by converting to ``dtype``) are refused, naming the tensor."""
    state: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    with tqdm(total=hf_weight_count(config), desc="Converting", unit="tensor") as progress:
        for hf_name, tensor in tensors:
            if IGNORED.fullmatch(hf_name) or (config.tie_embeddings and hf_name == "lm_head.weight"):
                continue
            name, part = our_name(hf_name)
            tensor = tensor.to(dtype).contiguous()
            check_finite({hf_name: tensor}, str(src))
            progress.update()
            if part is None:
                state[name] = tensor
                continue
            parts = pending.setdefault(name, {})
            parts[part] = tensor
            order = FUSED_PARTS[name.split(".")[-2]]
            if len(parts) == len(order):
                state[name] = torch.cat([parts[p] for p in order], dim=0)
                del pending[name]
    assert not pending, f"incomplete fused tensors: {sorted(pending)}"
    return state


def split_tensors(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`fuse_tensors`: our state dict under Hugging Face names, fused matrices split apart."""
    hf_shapes = hf_weight_shapes(config)
    out: dict[str, torch.Tensor] = {}
    parts_of: dict[str, dict[str, str]] = {}  # our fused name -> part -> HF name
    for hf_name in hf_shapes:
        name, part = our_name(hf_name)
        if part is None:
            out[hf_name] = state[name]
        else:
            parts_of.setdefault(name, {})[part] = hf_name
    for name, parts in parts_of.items():
        order = FUSED_PARTS[name.split(".")[-2]]
        for part, tensor in zip(order, state[name].split([hf_shapes[parts[p]][0] for p in order]), strict=True):
            out[parts[part]] = tensor
    return out
