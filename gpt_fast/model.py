"""Llama-family decoder: RMSNorm, rotary embeddings, multi-head / grouped-query attention, SwiGLU MLP.

Two fusions are built into the weight layout (the converter writes them): q, k and v projections are one
``wqkv`` matrix, and the MLP's gate and up projections are one ``w13`` matrix, so each layer reads its weights
in four matrix-vector products per decoded token instead of seven.
Rotary embeddings use the Hugging Face ("rotate half") layout, so HF weights load without permutation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpt_fast.cache import DecodeState, KVCache
from gpt_fast.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim // 2] (float32), with the checkpoint's scaling applied."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "divisors":
        return inv_freq / torch.tensor(scaling.divisors, dtype=torch.float32)
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(
    config: ModelConfig, max_seq_length: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_length, head_dim // 2] in float32."""
    inv_freq = rope_inv_freq(config.head_dim, config.rope_base, config.rope_scaling).to(device)
    angles = torch.outer(torch.arange(max_seq_length, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, D] by position; ``cos``/``sin`` are [T, D // 2] (positions shared by the rows) or
    [B, T, D // 2] (each row's own). Computed in float32."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]  # [T, 1, D/2] or [B, T, 1, D/2], broadcast over heads
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def attend_one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of a single query position, in float32: ``q`` [B, H, 1, D] over the cache ``k``, ``v``
    [B, H_kv, S, D] with the additive ``mask`` [1, S] (shared by the rows) or [B, 1, 1, S] (each row's own);
    returns [B, H, 1, D] in ``q``'s dtype.

    Written as broadcast products and sums rather than a call to an attention kernel: inductor fuses them with
    the query's rotary embedding and the mask into a few small reductions. On an H100 this decoded the
    SmolLM2-135M shape at 1162 tok/s against 995 with the SDPA math path (BENCHMARKS.md, 2026-11-22). Only for
    compiled steps: run eagerly, the products are materialized, 2-4x slower than SDPA on a CPU.
    """
    bsz, n_head, _, head_dim = q.shape
    n_kv, dtype = k.shape[1], q.dtype
    q = q.reshape(bsz, n_kv, n_head // n_kv, 1, head_dim).float()  # [B, H_kv, G, 1, D]: G query heads per kv head
    scores = (q * k[:, :, None].float()).sum(-1) * head_dim**-0.5 + mask  # [B, H_kv, G, S]
    weights = scores.softmax(dim=-1)[..., None]  # [B, H_kv, G, S, 1]
    y = (weights * v[:, :, None].float()).sum(3)  # [B, H_kv, G, D]
    return y.reshape(bsz, n_head, 1, head_dim).to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wqkv = nn.Linear(config.dim, config.q_size + 2 * config.kv_size, bias=False)
        self.wo = nn.Linear(config.q_size, config.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        input_pos: torch.Tensor,
        first_row: int = 0,
    ) -> torch.Tensor:
        cfg = self.config
        bsz, seqlen, _ = x.shape
        q, k, v = self.wqkv(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = apply_rope(q.view(bsz, seqlen, cfg.n_head, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(bsz, seqlen, cfg.n_local_heads, cfg.head_dim), cos, sin)
        v = v.view(bsz, seqlen, cfg.n_local_heads, cfg.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        k, v = self.kv_cache.update(input_pos, k, v, first_row)  # [B, H_kv, S, D]
        if seqlen == 1 and torch.compiler.is_compiling():  # eager: SDPA's fused kernel beats materialized products
            y = attend_one_query(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=cfg.n_head != cfg.n_local_heads)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, cfg.q_size))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.w13 = nn.Linear(config.dim, 2 * config.intermediate_size, bias=False)  # gate and up, stacked
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.intermediate_size, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        input_pos: torch.Tensor,
        first_row: int = 0,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos, first_row)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        self.decode_state: DecodeState | None = None
        self.max_batch_size = 0
        self.max_seq_length = 0

    def setup_caches(self, batch_size: int, max_seq_length: int) -> None:
        """Allocate the KV cache, the decode state and the rotary tables on the model's device and dtype, unless
        they already have this shape."""
        if (batch_size, max_seq_length) == (self.max_batch_size, self.max_seq_length):
            return
        weight = self.tok_embeddings.weight
        for layer in self.layers:
            layer.attention.kv_cache = None  # free the old buffers before allocating new ones
            layer.attention.kv_cache = KVCache(
                batch_size,
                self.config.n_local_heads,
                max_seq_length,
                self.config.head_dim,
                dtype=weight.dtype,
                device=weight.device,
            )
        self.decode_state = DecodeState(batch_size, max_seq_length, device=weight.device)
        cos, sin = rope_tables(self.config, max_seq_length, weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.max_batch_size, self.max_seq_length = batch_size, max_seq_length

    def forward(
        self, idx: torch.Tensor, input_pos: torch.Tensor, *, last_only: bool = False, first_row: int = 0
    ) -> torch.Tensor:
        """Logits [B, T, V] for tokens ``idx`` [B, T] ([B, 1, V] with ``last_only``) at positions ``input_pos``:
        [T], the same for every row (one prompt, or copies of it), or [B, T], each row's own (independent
        sequences decoded together). The rows are the cache's rows ``first_row`` to ``first_row + B - 1``, so
        that one sequence can be prefilled into its row while the others wait."""
        assert self.max_seq_length > 0, "setup_caches() must be called before forward()"
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [T, D/2] or [B, T, D/2]
        x = self.tok_embeddings(idx)
        key_pos = torch.arange(self.max_seq_length, device=idx.device)
        # [T, S] or [B, T, S], causal over the whole cache; additive and in the model's dtype once here rather
        # than per layer
        mask = torch.where(key_pos <= input_pos[..., None], 0.0, float("-inf")).to(x.dtype)
        if input_pos.dim() == 2:
            mask = mask[:, None]  # [B, 1, T, S]: the same for every head
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos, first_row)
        if last_only:
            x = x[:, -1:]
        x = self.norm(x)
        return F.linear(x, self.tok_embeddings.weight) if self.output is None else self.output(x)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor a checkpoint for ``config`` must hold."""
    with torch.device("meta"):
        model = Transformer(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def weight_count(config: ModelConfig) -> tuple[int, int]:
    """``(tensors, parameters)`` a checkpoint for ``config`` holds, computed without listing them: cheap however
    large the config claims to be, so that a weights file can be checked against it before anything is built."""
    dim = config.dim
    per_layer = dim * (config.q_size + 2 * config.kv_size) + config.q_size * dim + 3 * dim * config.intermediate_size
    per_layer += 2 * dim  # the two norms
    tables = 1 if config.tie_embeddings else 2  # the embedding table, and the output projection unless tied
    return 6 * config.n_layer + tables + 1, tables * config.vocab_size * dim + config.n_layer * per_layer + dim


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights read to decode one token: all parameters except the embedding table, which is only
    gathered one row at a time — unless it is tied to the output projection, which reads all of it."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.output is not None:
        total -= model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.element_size()
    return total
