"""Our weight layout, from Hugging Face tensor names (the GGUF converter maps its names onto these too).

Every tensor of ours is one or more HF tensors concatenated along their first dimension and reshaped: q/k/v
into ``wqkv`` (weights and biases), gate/up into ``w13``, and in a mixture of experts every expert's gate/up
(or down) projection into one stacked ``w13`` [E, 2I, D] (or ``w2`` [E, D, I]). Tensors arrive one at a time;
each of ours is assembled as soon as its parts are complete, so peak memory is the output plus one group.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from gpt_fast.checkpoint.load import check_finite, check_shapes, check_tensor_count
from gpt_fast.convert.weight_files import TensorInfo
from gpt_fast.model.config import ModelConfig
from gpt_fast.model.transformer import weight_count, weight_shapes
from gpt_fast.util.device import DTYPES

IGNORED = re.compile(
    r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|rope_freqs\.weight"
)  # buffers some checkpoints hold
Shape = tuple[int, ...]


@dataclass(frozen=True)
class HfNaming:
    """How an architecture names its tensors, where families differ."""

    fused: bool = False  # one qkv_proj and one gate_up_proj (Phi-3) instead of q/k/v and gate/up
    moe: str = "mlp"  # the module holding the router ("gate") and the experts
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # each expert's gate, up, down
    stacked: bool = False  # experts stacked in two tensors, as transformers 5 holds them in memory


NAMINGS = {
    "Phi3ForCausalLM": HfNaming(fused=True),
    "MixtralForCausalLM": HfNaming(moe="block_sparse_moe", experts=("w1", "w3", "w2")),
}
# transformers 5's modules (what load_state_dict takes) stack the experts under "mlp" whatever the files say
MODULE_NAMING = HfNaming(stacked=True)


def naming(architecture: str) -> HfNaming:
    return NAMINGS.get(architecture, HfNaming())


def hf_weight_count(config: ModelConfig, names: HfNaming = HfNaming()) -> int:
    """How many tensors :func:`hf_weight_shapes` lists, computed without listing them."""
    per_layer = 2 + (2 if names.fused else 4)  # two norms; q, k, v, o (or qkv, o)
    per_layer += (3 if config.qkv_bias else 0) + (2 if config.qk_norm else 0) + (2 if config.post_norms else 0)
    if config.is_moe:
        per_layer += 1 + (2 if names.stacked else 3 * config.n_experts)
        per_layer += 4 if config.shared_expert_size else 0
    else:
        per_layer += 2 if names.fused else 3
    return per_layer * config.n_layer + (2 if config.tie_embeddings else 3)


def max_source_tensors(config: ModelConfig, names: HfNaming = HfNaming()) -> int:
    """The most tensors a source of this shape may hold: its weights, a copy of a tied output projection, and the
    buffers some checkpoints keep (one rotary table per layer, one rope_freqs)."""
    return hf_weight_count(config, names) + config.n_layer + 2


def hf_layout(config: ModelConfig, names: HfNaming = HfNaming()) -> dict[str, list[tuple[str, Shape]]]:
    """Each of our tensors' HF parts, in order, with their shapes."""
    dim, inter, head = config.dim, config.intermediate_size, config.head_dim
    layout = {"tok_embeddings.weight": [("model.embed_tokens.weight", (config.vocab_size, dim))]}
    layout["norm.weight"] = [("model.norm.weight", (dim,))]
    if not config.tie_embeddings:
        layout["output.weight"] = [("lm_head.weight", (config.vocab_size, dim))]
    qkv = (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size))
    for i in range(config.n_layer):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        attn = hf + "self_attn."
        if names.fused:
            layout[ours + "attention.wqkv.weight"] = [
                (attn + "qkv_proj.weight", (config.q_size + 2 * config.kv_size, dim))
            ]
        else:
            layout[ours + "attention.wqkv.weight"] = [(f"{attn}{p}_proj.weight", (n, dim)) for p, n in qkv]
        if config.qkv_bias:
            layout[ours + "attention.wqkv.bias"] = [(f"{attn}{p}_proj.bias", (n,)) for p, n in qkv]
        layout[ours + "attention.wo.weight"] = [(attn + "o_proj.weight", (dim, config.q_size))]
        if config.qk_norm:
            layout[ours + "attention.q_norm.weight"] = [(attn + "q_norm.weight", (head,))]
            layout[ours + "attention.k_norm.weight"] = [(attn + "k_norm.weight", (head,))]
        norms = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
        if config.post_norms:  # Gemma: post_attention_layernorm is on the attention's output
            norms = {
                "attention_norm": "input_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffn_norm": "post_feedforward_layernorm",
            }
        for our_norm, hf_norm in norms.items():
            layout[f"{ours}{our_norm}.weight"] = [(f"{hf}{hf_norm}.weight", (dim,))]
        mlp = moe_layout(config, names, hf) if config.is_moe else dense_layout(dim, inter, names, hf + "mlp.")
        layout |= {f"{ours}feed_forward.{name}": parts for name, parts in mlp.items()}
    return layout


def dense_layout(dim: int, inter: int, names: HfNaming, prefix: str) -> dict[str, list[tuple[str, Shape]]]:
    """A gated MLP's tensors (``w13.weight``, ``w2.weight``) from HF's under ``prefix``."""
    if names.fused:
        w13 = [(prefix + "gate_up_proj.weight", (2 * inter, dim))]
    else:
        w13 = [(prefix + "gate_proj.weight", (inter, dim)), (prefix + "up_proj.weight", (inter, dim))]
    return {"w13.weight": w13, "w2.weight": [(prefix + "down_proj.weight", (dim, inter))]}


def moe_layout(config: ModelConfig, names: HfNaming, layer: str) -> dict[str, list[tuple[str, Shape]]]:
    dim, inter, n_experts = config.dim, config.intermediate_size, config.n_experts
    prefix = f"{layer}{'mlp' if names.stacked else names.moe}."
    layout = {"router.weight": [(prefix + "gate.weight", (n_experts, dim))]}
    if names.stacked:
        layout["w13"] = [(prefix + "experts.gate_up_proj", (n_experts, 2 * inter, dim))]
        layout["w2"] = [(prefix + "experts.down_proj", (n_experts, dim, inter))]
    else:
        gate, up, down = names.experts
        layout["w13"] = [
            (f"{prefix}experts.{e}.{part}.weight", (inter, dim)) for e in range(n_experts) for part in (gate, up)
        ]
        layout["w2"] = [(f"{prefix}experts.{e}.{down}.weight", (dim, inter)) for e in range(n_experts)]
    if config.shared_expert_size:
        shared = dense_layout(dim, config.shared_expert_size, HfNaming(), prefix + "shared_expert.")
        layout |= {f"shared.{name}": parts for name, parts in shared.items()}
        layout["shared_gate.weight"] = [(prefix + "shared_expert_gate.weight", (1, dim))]
    return layout


def hf_weight_shapes(config: ModelConfig, names: HfNaming = HfNaming()) -> dict[str, Shape]:
    """Every tensor an HF checkpoint of this shape holds, with its shape."""
    return {hf: shape for parts in hf_layout(config, names).values() for hf, shape in parts}


def check_tensors(infos: dict[str, TensorInfo], config: ModelConfig, src: Path, names: HfNaming = HfNaming()) -> None:
    """Missing and unexpected names (all of them), then the first shape that disagrees with config.json."""
    present = {n: info.shape for n, info in infos.items() if not IGNORED.fullmatch(n)}
    if config.tie_embeddings:
        present.pop("lm_head.weight", None)  # tied: a saved copy of the embedding table is redundant
    check_tensor_count(len(present), hf_weight_count(config, names), config, str(src))
    check_shapes(present, hf_weight_shapes(config, names), str(src))


def source_dtype(infos: dict[str, TensorInfo]) -> torch.dtype:
    """The dtype holding most of the parameters (float32 for float64 sources)."""
    counts: Counter[torch.dtype] = Counter()
    for info in infos.values():
        counts[info.dtype] += max(1, torch.Size(info.shape).numel())
    dtype = counts.most_common(1)[0][0]
    return dtype if dtype in DTYPES.values() else torch.float32


def check_memory(config: ModelConfig, dtype: torch.dtype, src: Path) -> None:
    """Refuse, before any tensor is read, a model whose converted weights (held in memory until written) exceed
    the memory available: a header may claim gigabytes that a sparse file does not hold, and the kernel's
    out-of-memory killer would end the process without a word."""
    needed = weight_count(config)[1] * dtype.itemsize
    available = available_memory()
    if available is not None and needed > available:
        raise ValueError(
            f"{src}: converting needs about {needed / 2**30:.1f} GiB of memory (the model's "
            f"{weight_count(config)[1]} parameters in {str(dtype).removeprefix('torch.')}), "
            f"{available / 2**30:.1f} GiB are available"
        )


def available_memory() -> int | None:
    """Bytes this process may still allocate: the kernel's MemAvailable plus free swap, within the cgroup's
    memory.max where one is set (Linux); None where neither can be read."""
    limits = []
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        limits.append((int(meminfo["MemAvailable"].split()[0]) + int(meminfo["SwapFree"].split()[0])) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    try:
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            limits.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def fuse_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: ModelConfig,
    dtype: torch.dtype,
    src: Path,
    names: HfNaming = HfNaming(),
) -> dict[str, torch.Tensor]:
    """Our state dict from (HF name, tensor) pairs already checked by :func:`check_tensors`; NaN and infinite
    values (in the source, or made by converting to ``dtype``) are refused, naming the tensor."""
    check_memory(config, dtype, src)
    layout = hf_layout(config, names)
    shapes = weight_shapes(config)
    target = {hf: ours for ours, parts in layout.items() for hf, _ in parts}
    state: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    with tqdm(total=len(target), desc="Converting", unit="tensor") as progress:
        for hf_name, tensor in tensors:
            if IGNORED.fullmatch(hf_name) or (config.tie_embeddings and hf_name == "lm_head.weight"):
                continue
            name = target[hf_name]
            tensor = tensor.to(dtype).contiguous()
            check_finite({hf_name: tensor}, str(src))
            progress.update()
            parts = pending.setdefault(name, {})
            parts[hf_name] = tensor
            if len(parts) == len(layout[name]):
                state[name] = torch.cat([parts[hf] for hf, _ in layout[name]]).reshape(shapes[name])
                del pending[name]
    assert not pending, f"incomplete fused tensors: {sorted(pending)}"
    return state


def split_tensors(
    state: dict[str, torch.Tensor], config: ModelConfig, names: HfNaming = HfNaming()
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`fuse_tensors`: our state dict under HF names, our tensors split into their parts
    (views, no copies)."""
    out: dict[str, torch.Tensor] = {}
    for name, parts in hf_layout(config, names).items():
        trailing = parts[0][1][1:]
        pieces = state[name].reshape(-1, *trailing).split([shape[0] for _, shape in parts])
        out |= {hf: piece.reshape(shape) for (hf, shape), piece in zip(parts, pieces, strict=True)}
    return out
