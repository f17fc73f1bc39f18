"""Llama-family decoder: RMSNorm, rotary embeddings, multi-head / grouped-query attention, SwiGLU MLP.

Other families are the same decoder with features switched on by their config (q/k/v biases, q/k norms, norms
with an offset, GeGLU, scaled embeddings, post-norms, soft-capped logits, sliding-window layers with their own
rotary base, Phi-3's longrope, a mixture of experts); with every feature off the computation is exactly Llama's.

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

from gpt_fast.model.cache import BlockTable, DecodeState, KVCache, PagedKVCache
from gpt_fast.model.config import ModelConfig, RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """RMSNorm over the last dimension, normalized in float32: times ``weight`` after rounding to ``x``'s dtype, or
    (Gemma, ``offset`` not 0) times ``offset + weight`` in float32, rounded once at the end."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (offset + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    # The norm as an operator of its own (gpt_fast.accel.invariant sets it, with rms_norm's arguments); None:
    # rms_norm.
    kernel = None

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = rms_norm if self.kernel is None else self.kernel
        return norm(x, self.weight, self.eps, self.offset)


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None, max_seq_length: int = 0) -> torch.Tensor:
    """Inverse rotary frequencies [head_dim // 2] (float32), with the checkpoint's scaling applied. ``longrope``
    uses its long factors for a cache longer than the original context (``max_seq_length``), its short ones
    otherwise: one choice per cache, where transformers switches when the sequence grows past that length."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if scaling is not None and scaling.kind == "longrope":
        long = max_seq_length > scaling.original_max_position_embeddings
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
        return 1.0 / (factors * base**exponents)
    inv_freq = 1.0 / (base**exponents)
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
    config: ModelConfig, max_seq_length: int, device: torch.device | str, *, local: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_seq_length, head_dim // 2] in float32; ``local``: those of the sliding layers,
    with their own unscaled base (``rope_local_base``)."""
    base, scaling = (config.rope_local_base, None) if local else (config.rope_base, config.rope_scaling)
    inv_freq = rope_inv_freq(config.head_dim, base, scaling, max_seq_length).to(device)
    angles = torch.outer(torch.arange(max_seq_length, device=device, dtype=torch.float32), inv_freq)
    if scaling is not None and scaling.attention_factor is not None:  # longrope scales q and k
        return angles.cos() * scaling.attention_factor, angles.sin() * scaling.attention_factor
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, D] by position; ``cos``/``sin`` are [T, D // 2] (positions shared by the rows) or
    [B, T, D // 2] (each row's own). Computed in float32."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]  # [T, 1, D/2] or [B, T, 1, D/2], broadcast over heads
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def attend_one_query(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of a single query position, in float32: ``q`` [B, H, 1, D] over the cache ``k``, ``v``
    [B, H_kv, S, D] with the additive ``mask`` [1, S] (shared by the rows) or [B, 1, 1, S] (each row's own);
    returns [B, H, 1, D] in ``q``'s dtype. Scores are scaled by ``scale`` (default head_dim ** -0.5), then
    soft-capped when ``softcap`` is given.

    Written as broadcast products and sums rather than a call to an attention kernel: inductor fuses them with
    the query's rotary embedding and the mask into a few small reductions. On an H100 this decoded the
    SmolLM2-135M shape at 1162 tok/s against 995 with the SDPA math path (docs/bench/HISTORY.md, 2026-11-22). Only for
    compiled steps: run eagerly, the products are materialized, 2-4x slower than SDPA on a CPU.
    """
    bsz, n_head, _, head_dim = q.shape
    n_kv, dtype = k.shape[1], q.dtype
    q = q.reshape(bsz, n_kv, n_head // n_kv, 1, head_dim).float()  # [B, H_kv, G, 1, D]: G query heads per kv head
    scores = (q * k[:, :, None].float()).sum(-1) * (head_dim**-0.5 if scale is None else scale)  # [B, H_kv, G, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    weights = scores.softmax(dim=-1)[..., None]  # [B, H_kv, G, S, 1]
    y = (weights * v[:, :, None].float()).sum(3)  # [B, H_kv, G, D]
    return y.reshape(bsz, n_head, 1, head_dim).to(dtype)


def attend_softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with soft-capped scores, which SDPA cannot do, in float32: ``q`` [B, H, T, D] over ``k``, ``v``
    [B, H_kv, S, D] with the additive ``mask`` [T, S]; returns [B, H, T, D] in ``q``'s dtype."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1).float() for t in (k, v))  # [B, H, S, D]
    scores = q.float() @ k.transpose(-1, -2) * scale  # [B, H, T, S]
    scores = torch.tanh(scores / softcap) * softcap + mask
    return (scores.softmax(dim=-1) @ v).to(q.dtype)


class Attention(nn.Module):
    # One decode step's rotary embedding, cache write and attention fused, over a static cache or a paged one and
    # its block table (gpt_fast.accel.decode_attention sets it); None: the PyTorch code below.
    decode_kernel = None
    # The same for any number of positions, each computed on its own (gpt_fast.accel.invariant sets it), taking
    # every step but a prompt's causal prefill, over a static cache only (a paged cache's steps take the code
    # below); None: the code below.
    rows_kernel = None

    def __init__(self, config: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.window = window  # sliding layers: the positions seen (their mask says the same)
        self.wqkv = nn.Linear(config.dim, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.wo = nn.Linear(config.q_size, config.dim, bias=False)
        self.kv_cache: KVCache | None = None
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps, config.norm_offset)
        self.scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar**-0.5
        self.softcap = config.attn_logit_softcap

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        input_pos: torch.Tensor,
        first_row: int = 0,
    ) -> torch.Tensor:
        """``mask`` None: the tokens are their sequence's first, so each attends causally to the new keys alone."""
        return self.wo(self.attend(self.wqkv(x), cos, sin, mask, input_pos, first_row))

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        input_pos: torch.Tensor,
        first_row: int = 0,
    ) -> torch.Tensor:
        """The attention of the projected queries, keys and values ``qkv`` [B, T, q_size + 2 * kv_size], before
        ``wo``: [B, T, q_size]."""
        cfg = self.config
        bsz, seqlen, _ = qkv.shape
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(bsz, seqlen, cfg.n_head, cfg.head_dim)
        k = k.view(bsz, seqlen, cfg.n_local_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(bsz, seqlen, cfg.n_local_heads, cfg.head_dim)
        cache, scale = self.kv_cache, self.scale or cfg.head_dim**-0.5
        args = (q, k, v, cos, sin, cache.kv, input_pos, first_row, scale, self.softcap, self.window)
        if seqlen == 1 and self.decode_kernel is not None and torch.compiler.is_compiling():
            return self.decode_kernel(*args, cache.blocks).view(bsz, seqlen, cfg.q_size)
        if mask is not None and self.rows_kernel is not None and not cache.paged:
            return self.rows_kernel(*args).view(bsz, seqlen, cfg.q_size)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        seen = 0 if mask is None else mask.shape[-1]  # the keys the mask covers (none: the prompt's own alone)
        keys, values = self.kv_cache.update(input_pos, k, v, first_row, seen)  # [B, H_kv, seen, D]
        gqa = cfg.n_head != cfg.n_local_heads
        if mask is None:  # a prompt from position 0: its own keys, causally (flash skips the masked blocks)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=self.scale)
        elif seqlen == 1 and torch.compiler.is_compiling():  # eager: SDPA's kernel beats materialized products
            y = attend_one_query(q, keys, values, mask, scale=self.scale, softcap=self.softcap)
        elif self.softcap is not None:
            y = attend_softcapped(q, keys, values, mask, self.scale or cfg.head_dim**-0.5, self.softcap)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa, scale=self.scale)
        return y.transpose(1, 2).reshape(bsz, seqlen, cfg.q_size)


def host_reads_free(t: torch.Tensor) -> bool:
    """Whether code may read ``t``'s values on the host to choose what to compute: an eager step on the CPU, where
    the read costs nothing and no compiled graph needs fixed shapes (on a GPU it would wait for the device)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated MLP's hidden state: SwiGLU (``silu``) or GeGLU with tanh-approximated GeLU (``gelu_tanh``)."""
    return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up


class FeedForward(nn.Module):
    # The hidden state of a compiled decode step as a kernel of its own (gpt_fast.accel.gated_activation sets it:
    # it takes w13's output and the activation's name); None: the PyTorch code (gated).
    activation_kernel = None
    # w13 and the activation of a compiled step of one row, as one kernel (gpt_fast.accel.linear sets it: it takes
    # the row, w13 and the activation's name); None: w13, then the above.
    gated_kernel = None

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.activation = config.mlp_activation
        self.w13 = nn.Linear(config.dim, 2 * self.intermediate_size, bias=False)  # gate and up, stacked
        self.w2 = nn.Linear(self.intermediate_size, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1] and self.gated_kernel is not None and torch.compiler.is_compiling():
            return self.w2(self.gated_kernel(x, self.w13, self.activation))
        gate_up = self.w13(x)  # [B, T, 2I]
        if x.shape[1] == 1 and self.activation_kernel is not None and torch.compiler.is_compiling():
            return self.w2(self.activation_kernel(gate_up, self.activation))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.w2(gated(gate, up, self.activation))


class MoEFeedForward(nn.Module):
    """A mixture of experts: a router picks ``n_active_experts`` of ``n_experts`` gated MLPs per token (softmax
    over the router's logits in float32, then top-k, as transformers does) and sums their outputs weighted by
    the chosen probabilities (renormalized with ``norm_topk_prob``); Qwen2-MoE adds a shared expert whose output
    is weighted by a sigmoid gate. The experts' weights are stacked: ``w13`` [E, 2I, D], ``w2`` [E, D, I]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        n_experts, inter, dim = config.n_experts, config.intermediate_size, config.dim
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * inter, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter))
        self.shared = self.shared_gate = None
        if config.shared_expert_size:
            self.shared = FeedForward(config, config.shared_expert_size)
            self.shared_gate = nn.Linear(dim, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert weights and ids, each [N, k], for tokens ``x`` [N, D]."""
        probs = F.softmax(self.router(x).float(), dim=-1)  # [N, E]
        weights, ids = torch.topk(probs, self.config.n_active_experts, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        weights, ids = self.route(flat)
        if ids.numel() < self.config.n_experts:  # few tokens (decode): read only the chosen experts
            y = self.chosen_experts(flat, weights, ids)
        else:  # many tokens (prefill): every expert once, for every token, weighted 0 where not chosen
            y = self.all_experts(flat, weights, ids)
        if self.shared is not None:
            y = y + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        return y.view(x.shape)

    def chosen_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens ``x`` [N, D] through their chosen experts ``ids`` [N, k], gathering only those weights."""
        inter = self.config.intermediate_size
        hidden = torch.einsum("nd,nkhd->nkh", x, self.w13[ids])  # [N, k, 2I]
        hidden = gated(hidden[..., :inter], hidden[..., inter:], self.config.mlp_activation)  # [N, k, I]
        out = torch.einsum("nki,nkdi->nkd", hidden, self.w2[ids])  # [N, k, D]
        return (out * weights[..., None].to(out.dtype)).sum(dim=1)

    def all_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Tokens ``x`` [N, D] through every expert in turn, each output weighted by its routing weight."""
        inter = self.config.intermediate_size
        dense = torch.zeros(x.shape[0], self.config.n_experts, dtype=weights.dtype, device=x.device)
        dense = dense.scatter(1, ids, weights).to(x.dtype)  # [N, E]
        y = torch.zeros_like(x)
        for e in range(self.config.n_experts):
            hidden = x @ self.w13[e].t()  # [N, 2I]
            hidden = gated(hidden[:, :inter], hidden[:, inter:], self.config.mlp_activation)
            y = y + dense[:, e, None] * (hidden @ self.w2[e].t())
        return y


class TransformerBlock(nn.Module):
    # A compiled step of one row through this layer as four products, each norm inside the product after it and
    # each residual add inside the product before it (gpt_fast.accel.linear sets it, for a layer it computes: see
    # one_row); None: the code below.
    row_kernels = None

    def __init__(self, config: ModelConfig, layer_type: str = "full_attention") -> None:
        super().__init__()
        self.layer_type = layer_type
        self.attention = Attention(config, config.sliding_window if layer_type == "sliding_attention" else None)
        self.feed_forward = MoEFeedForward(config) if config.is_moe else FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
        self.post_attention_norm = self.post_ffn_norm = None
        if config.post_norms:
            self.post_attention_norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
            self.post_ffn_norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        input_pos: torch.Tensor,
        first_row: int = 0,
    ) -> torch.Tensor:
        if self.row_kernels is not None and x.numel() == x.shape[-1] and torch.compiler.is_compiling():
            return self.one_row(x, cos, sin, mask, input_pos, first_row)
        attended = self.attention(self.attention_norm(x), cos, sin, mask, input_pos, first_row)
        if self.post_attention_norm is not None:
            attended = self.post_attention_norm(attended)
        h = x + attended
        out = self.feed_forward(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            out = self.post_ffn_norm(out)
        return h + out

    def one_row(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None,
        input_pos: torch.Tensor,
        first_row: int = 0,
    ) -> torch.Tensor:
        """:meth:`forward` of one row ``x`` [1, 1, D] through :attr:`row_kernels`, for a layer without post-norms
        or experts whose norms have no offset: the same operations, rounded alike, in four products and the
        attention."""
        kernels, attention, mlp = self.row_kernels, self.attention, self.feed_forward
        qkv = kernels.linear(x, attention.wqkv, norm=self.attention_norm)
        h = kernels.linear(attention.attend(qkv, cos, sin, mask, input_pos, first_row), attention.wo, residual=x)
        hidden = kernels.gated(h, mlp.w13, mlp.activation, norm=self.ffn_norm)
        return kernels.linear(hidden, mlp.w2, residual=h)


@torch.compiler.nested_compile_region
def layer_region(layer: TransformerBlock, *args: torch.Tensor | int | None) -> torch.Tensor:
    """One layer, marked as a region torch.compile traces and compiles once and then reuses for every layer called
    with inputs of the same shapes (regional compilation): a 32-layer step compiles about one layer's code instead
    of 32 copies of it. The price: inductor cannot fuse across a layer's boundary (a layer's last residual add with
    the next layer's norm). Without compilation it is a plain call."""
    return layer(*args)


class Transformer(nn.Module):
    # The tied output projection's product, with F.linear's arguments (gpt_fast.accel.invariant sets it); None:
    # F.linear.
    head_kernel = None
    # Every layer of a compiled one-token step of a one-row static cache as one operator, called with (model, x,
    # input_pos, first_row), whether it takes eager steps too, whether it takes steps of one token per row of any
    # rows of a static or paged cache (a server's), whether it also applies the final norm and the output projection
    # (it returns logits, not the residual), and what it needs done with the model once caches are allocated, called
    # with the model (gpt_fast.accel.persistent sets them); None: the layers' code, nothing.
    layers_kernel = None
    layers_kernel_eager = False
    layers_kernel_rows = False
    layers_kernel_logits = False
    caches_ready = None
    # The caches as the layers kernel reads them, where caches_ready keeps them; dropped before setup_caches replaces
    # the caches, so that the old ones are freed before the new ones are allocated.
    layers_kernel_caches = None
    # What the decode steps (gpt_fast.generation.decode) hand to gpt_fast.generation.sampling.sample for top-k
    # sampling, a
    # gpt_fast.generation.sampling.TopKSampler (gpt_fast.accel.top_k sets it); None: torch.topk. The model never calls
    # it.
    top_k_sampler = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        embeddings = torch.empty(config.vocab_size, config.dim)  # [V, D]
        if not embeddings.is_meta:  # as nn.Embedding initializes it; on the meta device torch's would import dynamo
            nn.init.normal_(embeddings)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim, _weight=embeddings)
        self.layers = nn.ModuleList(TransformerBlock(config, config.layer_type(i)) for i in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_offset)
        self.output = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        self.decode_state: DecodeState | None = None
        self.regional_compile = False  # compile the layers as one reused region (see layer_region)
        self.block_table: BlockTable | None = None  # a paged cache's (setup_caches)
        self.max_batch_size = 0
        self.max_seq_length = 0
        # The KV cache's dtype by name (None: the model's). A name, not a torch.dtype: a compiled step saved ahead
        # of time (gpt_fast/generation/precompile.py) does not load again with a torch.dtype among the attributes.
        self.kv_dtype_name: str | None = None
        self.paged_heads_major = False  # a paged cache's layout (PagedKVCache.heads_major), as its kernels read it
        self.cache_layout: tuple[object, ...] = ()

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the one :attr:`kv_dtype_name` names, else the model's (the dtype of its final
        norm: the embedding table may be quantized)."""
        return getattr(torch, self.kv_dtype_name) if self.kv_dtype_name else self.norm.weight.dtype

    def setup_caches(
        self, batch_size: int, max_seq_length: int, *, blocks: int | None = None, block_size: int = 16
    ) -> None:
        """Allocate the KV cache, the decode state and the rotary tables on the model's device and dtype (the
        cache in :attr:`kv_dtype`), unless they already have this shape. The cache is static (a row
        of ``max_seq_length`` positions for each of ``batch_size`` sequences) or, given ``blocks``, paged: that many
        blocks of ``block_size`` positions, which the rows of :attr:`block_table` hand out (block 0 is the sink, see
        :class:`BlockTable`)."""
        weight, kv_dtype = self.norm.weight, self.kv_dtype
        paged = (block_size, self.paged_heads_major) if blocks is not None else None
        layout = (batch_size, max_seq_length, blocks, paged, kv_dtype)
        if layout == self.cache_layout:
            return
        cfg, where = self.config, {"dtype": kv_dtype, "device": weight.device}
        for layer in self.layers:
            layer.attention.kv_cache = None  # free the old buffers before allocating new ones
        self.layers_kernel_caches = None
        self.block_table = None
        if blocks is not None:
            self.block_table = BlockTable(batch_size, max_seq_length, block_size, device=weight.device)
        for layer in self.layers:
            if self.block_table is None:
                cache = KVCache(batch_size, cfg.n_local_heads, max_seq_length, cfg.head_dim, **where)
            else:
                cache = PagedKVCache(
                    blocks,
                    self.block_table,
                    cfg.n_local_heads,
                    cfg.head_dim,
                    heads_major=self.paged_heads_major,
                    **where,
                )
            layer.attention.kv_cache = cache
        self.decode_state = DecodeState(batch_size, max_seq_length, device=weight.device)
        cos, sin = rope_tables(self.config, max_seq_length, weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if self.config.rope_local_base is not None:
            cos, sin = rope_tables(self.config, max_seq_length, weight.device, local=True)
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)
        if self.config.embedding_scale != 1.0:  # rounded to the model's dtype, as transformers does
            scale = torch.tensor(self.config.embedding_scale, dtype=weight.dtype, device=weight.device)
            self.register_buffer("embedding_scale", scale, persistent=False)
        self.max_batch_size, self.max_seq_length = batch_size, max_seq_length
        self.cache_layout = layout
        if self.caches_ready is not None:
            self.caches_ready(self)

    def forward(
        self,
        idx: torch.Tensor,
        input_pos: torch.Tensor,
        *,
        last_only: bool = False,
        first_row: int = 0,
        from_start: bool = False,
        last_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] for tokens ``idx`` [B, T] ([B, 1, V] with ``last_only``, or for the one position
        ``last_index`` holds: [1] for every row, or [B] each row's own; a padded prompt's last token) at positions
        ``input_pos``:
        [T], the same for every row (one prompt, or copies of it), or [B, T], each row's own (independent
        sequences decoded together). The rows are the cache's rows ``first_row`` to ``first_row + B - 1``, so
        that one sequence can be prefilled into its row while the others wait. ``from_start`` says that
        ``input_pos`` is ``0 .. T - 1`` (a prompt's prefill): the full-attention layers then attend causally over
        the new keys alone, with SDPA's causal kernels, rather than over the whole cache through a mask (a
        1024-token prompt's first token on the Llama-2-7B shape: docs/bench/HISTORY.md, 2026-11-23e)."""
        assert self.max_seq_length > 0, "setup_caches() must be called before forward()"
        x = self.tok_embeddings(idx)
        if self.config.embedding_scale != 1.0:
            x = x * self.embedding_scale
        if self.layers_kernel is not None and self._layers_kernel_takes(idx, input_pos):
            x = self.layers_kernel(self, x, input_pos, first_row)
            if self.layers_kernel_logits:  # [B, 1, V]
                return self._capped(x)
        else:
            x = self._layers(x, input_pos, first_row, from_start)
        if last_index is not None:  # [1] or [B]
            x = x.gather(1, last_index.view(-1, 1, 1).expand(x.shape[0], 1, x.shape[-1]))  # [B, 1, D]
        elif last_only:
            x = x[:, -1:]
        x = self.norm(x)
        return self._capped(self.tied_output(x) if self.output is None else self.output(x))

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [..., V] soft-capped where the config says (``final_logit_softcap``)."""
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _layers(self, x: torch.Tensor, input_pos: torch.Tensor, first_row: int, from_start: bool) -> torch.Tensor:
        """The residual stream ``x`` [B, T, D] through the layers' own code (:meth:`forward`'s arguments)."""
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [T, D/2] or [B, T, D/2]
        key_pos = torch.arange(self._keys_seen(input_pos), device=x.device)
        # [T, S] or [B, T, S], causal over the whole cache; additive and in the model's dtype once here rather
        # than per layer
        mask = torch.where(key_pos <= input_pos[..., None], 0.0, float("-inf")).to(x.dtype)
        causal = from_start and self.config.attn_logit_softcap is None  # soft-capped scores need the mask
        inputs = {"full_attention": (cos, sin, None if causal else mask)}  # each layer type's rotary tables, mask
        if self.config.sliding_window is not None:
            inputs["sliding_attention"] = self.sliding_inputs(input_pos, key_pos, cos, sin, mask)
        if input_pos.dim() == 2:  # masks [B, 1, T, S]: the same for every head
            inputs = {kind: (c, s, None if m is None else m[:, None]) for kind, (c, s, m) in inputs.items()}
        for layer in self.layers:
            args = (x, *inputs[layer.layer_type], input_pos, first_row)
            x = layer_region(layer, *args) if self.regional_compile else layer(*args)
        return x

    def _keys_seen(self, input_pos: torch.Tensor) -> int:
        """The cache positions a step's masks cover: every one, so that a compiled step's shapes stay fixed; in an
        eager step on the CPU, where reading the positions costs the host nothing, only those up to the last one
        written, so that attention neither gathers nor scores the rest of a long cache (a paged cache's every
        block, in every layer: a 10-token prompt's first token through `gpt-fast serve` took 135 ms with them, 70
        without, docs/bench/HISTORY.md, 2026-11-30k)."""
        return int(input_pos.max()) + 1 if host_reads_free(input_pos) else self.max_seq_length

    def tied_output(self, x: torch.Tensor) -> torch.Tensor:
        """The output projection of tied embeddings, ``x`` [..., D] -> [..., V]: the product with the embedding
        table, or a quantized table's own (``project``, :class:`gpt_fast.quant.layers.Int8Embedding`)."""
        if not isinstance(self.tok_embeddings, nn.Embedding):
            return self.tok_embeddings.project(x)
        return (F.linear if self.head_kernel is None else self.head_kernel)(x, self.tok_embeddings.weight, None)

    def _layers_kernel_takes(self, idx: torch.Tensor, input_pos: torch.Tensor) -> bool:
        """Whether ``layers_kernel`` takes this step, compiled or (``layers_kernel_eager``) not: one token of a
        one-row static cache, or (``layers_kernel_rows``) one token per row of any rows of the cache."""
        if idx.shape[1] != 1 or not (self.layers_kernel_eager or torch.compiler.is_compiling()):
            return False
        one_sequence = idx.shape[0] == 1 and self.max_batch_size == 1 and input_pos.dim() == 1
        return self.layers_kernel_rows or (one_sequence and self.block_table is None)

    def sliding_inputs(
        self, input_pos: torch.Tensor, key_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotary tables and mask ([T, S] or [B, T, S], as ``mask``) of the sliding layers: the causal ``mask``
        limited to the keys less than ``sliding_window`` positions back (the static cache keeps every key; the mask
        hides the old ones)."""
        if self.config.rope_local_base is not None:
            cos, sin = self.rope_local_cos[input_pos], self.rope_local_sin[input_pos]
        recent = input_pos[..., None] - key_pos < self.config.sliding_window  # [T, S] or [B, T, S]
        return cos, sin, torch.where(recent, mask, float("-inf"))


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor a checkpoint for ``config`` must hold."""
    with torch.device("meta"):
        model = Transformer(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def weight_count(config: ModelConfig) -> tuple[int, int]:
    """``(tensors, parameters)`` a checkpoint for ``config`` holds, computed without listing them: cheap however
    large the config claims to be, so that a weights file can be checked against it before anything is built."""
    dim = config.dim
    qkv = config.q_size + 2 * config.kv_size
    tensors, per_layer = 4, dim * qkv + config.q_size * dim + 2 * dim  # wqkv, wo, the two norms
    optional = (  # (present, tensors, parameters)
        (config.qkv_bias, 1, qkv),
        (config.qk_norm, 2, 2 * config.head_dim),
        (config.post_norms, 2, 2 * dim),
        (not config.is_moe, 2, 3 * dim * config.intermediate_size),
        (config.is_moe, 3, config.n_experts * dim * (1 + 3 * config.intermediate_size)),  # router and experts
        (config.shared_expert_size > 0, 3, dim * (1 + 3 * config.shared_expert_size)),  # shared expert and gate
    )
    for present, count, parameters in optional:
        if present:
            tensors, per_layer = tensors + count, per_layer + parameters
    tables = 1 if config.tie_embeddings else 2  # the embedding table, and the output projection unless tied
    return tensors * config.n_layer + tables + 1, tables * config.vocab_size * dim + config.n_layer * per_layer + dim


def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights read to decode one token: all parameters except the embedding table, which is only
    gathered one row at a time — unless it is tied to the output projection, which reads all of it — and, in a
    mixture of experts, except the experts the token is not routed to."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.output is not None:
        total -= model.tok_embeddings.weight.numel() * model.tok_embeddings.weight.element_size()
    config = model.config
    for layer in model.layers if config.is_moe else ():
        experts = sum(p.numel() * p.element_size() for p in (layer.feed_forward.w13, layer.feed_forward.w2))
        total -= experts * (config.n_experts - config.n_active_experts) // config.n_experts
    return total
