"""The decoder layers of a compiled decode step as one kernel (``layers_kernel``), or the model's own code.

- ``triton``: :mod:`gpt_fast.kernels.triton_persistent`, on CUDA GPUs (not ROCm) with Triton: one persistent kernel
  runs every layer of a one-token step of one sequence, where inductor launches about 14 kernels per layer. It is
  the ``torch.library.custom_op`` ``gpt_fast::decode_layers`` (it writes the KV caches), opaque to
  ``torch.compile``; CUDA graphs capture it. For a plain Llama-style decoder only (see :func:`check_layers_kernel`)
  and unquantized weights; other steps (a prefill, several rows) keep the model's code.
- ``torch``: the model's code, everywhere.

``auto`` is ``torch``: the kernel is there to be chosen and measured (BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from gpt_fast.kernels.persistent_table import TABLE_COLUMNS
from gpt_fast.model.config import ModelConfig, QuantConfig
from gpt_fast.model.transformer import Transformer
from gpt_fast.quant.products import resolve_kernel_choice
from gpt_fast.util.choices import LAYERS_KERNELS


def check_layers_kernel(config: ModelConfig, quantization: QuantConfig | None, programs: int) -> None:
    """Raise ``ValueError`` (one line) unless the persistent kernel computes this model over ``programs`` programs: a
    Llama-style decoder (RMSNorm, rotary embeddings on every layer, SwiGLU, no biases, q/k norms, post-norms,
    soft-caps, sliding windows or experts) of unquantized weights, with a power-of-two head size, and small enough
    that each program holds its share of a layer's weights at once (a small model: the kernel is for steps bound
    by launches, not by reading the weights)."""
    unsupported = {
        "quantized weights": quantization is not None,
        "q/k/v biases": config.qkv_bias,
        "q/k norms": config.qk_norm,
        "norms with an offset": config.norm_offset != 0.0,
        "a GeGLU MLP": config.mlp_activation != "silu",
        "post-norms": config.post_norms,
        "soft-capped attention": config.attn_logit_softcap is not None,
        "a query scale of its own": config.query_pre_attn_scalar is not None,
        "sliding-window layers": config.sliding_window is not None,
        "experts": config.is_moe,
        "a head size that is not a power of two": config.head_dim & (config.head_dim - 1) != 0,
    }
    for what, found in unsupported.items():
        if found:
            raise ValueError(f"--layers_kernel triton does not compute models with {what}")
    from gpt_fast.kernels import triton_persistent

    shape = (config.n_head, config.n_local_heads, config.head_dim, config.intermediate_size)
    tile = triton_persistent.layers_launch(shape, config.dim, programs).largest_tile
    if tile > triton_persistent.MAX_TILE:
        raise ValueError(
            f"--layers_kernel triton is for small models: this one gives each of {programs} programs "
            f"{tile} weights at once (at most {triton_persistent.MAX_TILE})"
        )


def resolve_layers_kernel(kernel: str, device: torch.device) -> str:
    """``auto``: the model's code. Choosing Triton (a CUDA GPU with Triton, not ROCm) registers the operator
    (:func:`register_layers_op`) before anything is compiled."""
    return resolve_kernel_choice(kernel, LAYERS_KERNELS, "layers kernel", device, "torch", register_layers_op)


def fill_pointer_table(model: Transformer) -> None:
    """Write the kernel's data pointers into ``model.layers_table`` [L, :data:`TABLE_COLUMNS`]: the model calls it
    once its caches are allocated, outside any CUDA graph (a capture cannot copy from the host), and the graphs
    read the table where it is."""
    rows = [[t.data_ptr() for t in (*_weights_of(layer), layer.attention.kv_cache.kv)] for layer in model.layers]
    model.layers_table.copy_(torch.tensor(rows, dtype=torch.int64))


def programs_for(device: torch.device) -> int:
    """One program per multiprocessor: all resident at once, which the kernel's barriers need."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def register_layers_op() -> None:
    """Register ``torch.ops.gpt_fast.decode_layers``, eagerly (``torch.compile`` cannot trace a registration).
    Nothing happens at import."""
    from gpt_fast.kernels import triton_persistent

    @torch.library.custom_op("gpt_fast::decode_layers", mutates_args=("kv",))
    def decode_layers(
        x: torch.Tensor,
        table: torch.Tensor,
        input_pos: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        weights: list[torch.Tensor],
        kv: list[torch.Tensor],
        shape: list[int],
        eps: float,
        scale: float,
    ) -> torch.Tensor:
        """The kernel reads the weights and caches through ``table`` (:func:`fill_pointer_table`); they are
        arguments so that the compiler orders the operator after what writes them."""
        return triton_persistent.decode_layers(
            x, table, input_pos, cos, sin, tuple(shape), eps, scale, programs_for(x.device)
        )

    @decode_layers.register_fake
    def _(x, table, input_pos, cos, sin, weights, kv, shape, eps, scale):  # noqa: ANN001, ANN202
        return torch.empty_like(x)


def _weights_of(layer: nn.Module) -> list[torch.Tensor]:
    """A layer's wqkv, wo, w13, w2, attention norm and MLP norm weights: the table's columns but the cache."""
    attention, mlp = layer.attention, layer.feed_forward
    return [attention.wqkv.weight, attention.wo.weight, mlp.w13.weight, mlp.w2.weight, layer.attention_norm.weight,
            layer.ffn_norm.weight]  # fmt: skip


def layer_weights(model: Transformer) -> list[torch.Tensor]:
    """Every layer's weights (:func:`_weights_of`), layer after layer."""
    return [weight for layer in model.layers for weight in _weights_of(layer)]


def persistent_layers(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """What :class:`gpt_fast.model.transformer.Transformer` calls as its ``layers_kernel``: the residual ``x`` [1, 1,
    D] after
    every layer, for the token at ``input_pos`` [1]."""
    cfg = model.config
    kv = [layer.attention.kv_cache.kv for layer in model.layers]
    shape = [cfg.n_head, cfg.n_local_heads, cfg.head_dim, cfg.intermediate_size, model.max_seq_length]
    return torch.ops.gpt_fast.decode_layers(
        x, model.layers_table, input_pos, model.rope_cos, model.rope_sin, layer_weights(model), kv, shape,
        cfg.norm_eps, cfg.head_dim**-0.5,
    )  # fmt: skip


def use_layers_kernel(model: nn.Module, kernel: str) -> None:
    """Give ``model`` the layers kernel ``kernel`` (a name :func:`resolve_layers_kernel` returned)."""
    if isinstance(model, Transformer):
        model.layers_kernel = persistent_layers if kernel == "triton" else None
        model.caches_ready = fill_pointer_table if kernel == "triton" else None
        if kernel == "triton":  # allocated here, outside any CUDA graph's memory pool
            table = torch.zeros(
                len(model.layers), TABLE_COLUMNS, dtype=torch.int64, device=model.tok_embeddings.weight.device
            )
            model.register_buffer("layers_table", table, persistent=False)
            if model.max_seq_length:
                fill_pointer_table(model)
