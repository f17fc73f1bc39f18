"""The decoder layers of a decode step of one token (a row) as one kernel (``layers_kernel``), or the model's code.

- ``triton``: :mod:`gpt_fast.kernels.triton_persistent`, on CUDA GPUs (not ROCm) with Triton: one persistent kernel
  runs every layer of a compiled one-token step of one sequence, where inductor launches about 14 kernels per layer.
  It is the ``torch.library.custom_op`` ``gpt_fast::decode_layers`` (it writes the KV caches), opaque to
  ``torch.compile``; CUDA graphs capture it. For a plain Llama-style decoder only (see :func:`check_layers_kernel`)
  and unquantized weights; other steps (a prefill, several rows) keep the model's code.
- ``cpp``: :mod:`gpt_fast.kernels.cpu_layers`, on an x86 CPU that builds our C++ kernels: every layer of a step of
  one token per row (one sequence's, or a server's rows in a static or paged cache) in one C++ operator,
  ``gpt_fast::decode_layers_cpu``, eager or compiled, where the model's code makes a few dozen Python (eager) or
  wrapper (compiled) calls per layer. float32 models whose products are ours (float32 weights, or the ``cpp`` and
  ``cpp-q8`` quantized kernels), Llama-style with q/k/v biases, norms with an offset, GeGLU and soft-capped attention
  (see :func:`check_cpp_layers`).
- ``torch``: the model's code, everywhere.

``auto`` is ``cpp`` where it computes the model (docs/cpu.md, "Where a token's time goes"), else ``torch``: the
Triton kernel is there to be chosen and measured (BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from gpt_fast.accel.choice import Context, choose
from gpt_fast.accel.options import LAYERS_KERNELS
from gpt_fast.kernels import cpu_gemv, cpu_layers
from gpt_fast.kernels.persistent_table import TABLE_COLUMNS
from gpt_fast.model.config import ModelConfig, QuantConfig
from gpt_fast.model.transformer import Transformer
from gpt_fast.quant.layers import Int4Linear, Int8Linear
from gpt_fast.quant.products import (
    CPP_INT4_GEMV_ROWS,
    CPP_INT8_GEMV_ROWS,
    CPP_KERNELS,
    cpp_shape_takes,
    cpp_usable,
)

# by kind (gpt_fast.kernels.cpu_layers.KINDS), the rows a product of the C++ layers takes one weight row at a time,
# as the layers' own calls choose (gpt_fast.quant.products: int8_linear, int4_cpp_linear); float32 and the q8
# kinds' products have no matrix product of their own (0: not read)
GEMV_ROWS = [0, CPP_INT8_GEMV_ROWS, 0, CPP_INT4_GEMV_ROWS, 0]


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


def check_cpp_layers(context: Context) -> None:
    """Raise ``ValueError`` (one line) unless the C++ operator computes this model's layers
    (:func:`cpp_layers_refusal`)."""
    if not cpp_usable(context.device):
        raise ValueError(
            f"the cpp layers kernel needs an x86 CPU with AVX2, a C++ compiler and ninja, not {context.device}"
        )
    refused = cpp_layers_refusal(context)
    if refused is not None:
        raise ValueError(f"--layers_kernel cpp does not compute models with {refused}")


def cpp_layers_refusal(context: Context) -> str | None:
    """What in this model the C++ operator does not compute, None where it computes it all: float32, products of
    float32 weights or our C++ quantized kernels, a decoder without q/k norms, post-norms, sliding-window layers or
    experts, a head size that is a multiple of 8, and one process computing every step alike (no tensor
    parallelism, whose layers all-reduce, nor batch-invariant steps, whose one-row and many-row steps must compute
    alike). The device is :func:`check_cpp_layers`'s to check."""
    config, quantized = context.config, context.quantization is not None
    unsupported = {
        f"{context.dtype} weights (it computes float32)": context.dtype not in (None, torch.float32),
        f"the {context.quant_kernel} quantized kernel (it computes cpp and cpp-q8)": (
            quantized and context.quant_kernel not in (None, *CPP_KERNELS)
        ),
        "quantized layers whose shapes our C++ products do not take": quantized and not _cpp_takes_layers(context),
        "tensor parallelism": context.tensor_parallel,
        "batch-invariant steps": context.batch_invariant,
        "q/k norms": config.qk_norm,
        "post-norms": config.post_norms,
        "sliding-window layers": config.sliding_window is not None,
        "experts": config.is_moe,
        "a head size that is not a multiple of 8": config.head_dim % 8 != 0,
    }
    return next((what for what, found in unsupported.items() if found), None)


def _cpp_computes(context: Context) -> bool:
    """Whether :func:`check_cpp_layers` passes."""
    return cpp_usable(context.device) and cpp_layers_refusal(context) is None


def _cpp_takes_layers(context: Context) -> bool:
    """Whether our C++ products take every quantized layer of the model, as the layers decide when they are
    prepared (:func:`gpt_fast.quant.products.cpp_shape_takes`): the inputs of wqkv and w13, wo, w2."""
    config, quant = context.config, context.quantization
    inputs = {config.dim, config.q_size, config.intermediate_size}
    return all(cpp_shape_takes(quant.mode, k, quant.group_size) for k in inputs)


def resolve_layers_kernel(kernel: str, context: Context) -> str:
    """``auto``: ``cpp`` where it computes the model (:func:`cpp_layers_refusal`, the dtype known), else the model's
    code. Choosing Triton (a CUDA GPU with Triton, not ROCm) registers its operator (:func:`register_layers_op`);
    C++ is built when the weights are read (:func:`load_layers_kernel`)."""
    if kernel == "triton" and context.cache_of_its_own is not None:
        raise ValueError(f"--layers_kernel triton reads a KV cache in the model's dtype, not {context.kv_dtype}")
    if kernel == "cpp":
        check_cpp_layers(context)
    elif not (kernel == "auto" and context.dtype is not None and _cpp_computes(context)):
        return choose(kernel, LAYERS_KERNELS, "layers kernel", context.device, "torch", register_layers_op)
    return "cpp"


def load_layers_kernel(kernel: str) -> None:
    """Build and load what the chosen ``kernel`` needs before the weights are read: our C++ library for ``cpp``
    (:func:`register_cpp_layers_op`; some 20 s the first time on a machine), after every check that needs no
    weights."""
    if kernel == "cpp":
        register_cpp_layers_op()


@functools.cache
def register_cpp_layers_op() -> None:
    """Build and load our C++ kernels (:func:`gpt_fast.kernels.cpu_gemv.load_cpu_kernels`) and give
    ``gpt_fast::decode_layers_cpu`` its shape function for ``torch.compile``."""
    cpu_gemv.load_cpu_kernels()
    torch.library.register_fake(
        "gpt_fast::decode_layers_cpu",
        lambda x, weights, plan, kv, *_args: x.new_empty(cpu_layers.output_shape(x, weights, plan, len(kv))),
    )


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


def persistent_layers(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor, first_row: int) -> torch.Tensor:
    """What :class:`gpt_fast.model.transformer.Transformer` calls as its ``layers_kernel``: the residual ``x`` [1, 1, D]
    after every layer, for the token at ``input_pos`` [1] (of the one-row cache: ``first_row`` is 0)."""
    cfg = model.config
    kv = [layer.attention.kv_cache.kv for layer in model.layers]
    shape = [cfg.n_head, cfg.n_local_heads, cfg.head_dim, cfg.intermediate_size, model.max_seq_length]
    return torch.ops.gpt_fast.decode_layers(
        x, model.layers_table, input_pos, model.rope_cos, model.rope_sin, layer_weights(model), kv, shape,
        cfg.norm_eps, cfg.head_dim**-0.5,
    )  # fmt: skip


def product_plan(linear: nn.Module) -> tuple[list[torch.Tensor], list[int]]:
    """A product's tensors and plan (kind, group size, bias) for :func:`gpt_fast.kernels.cpu_layers.decode_layers`."""
    found = _product_kind(linear)
    if found is None:
        what = getattr(linear, "kernel", getattr(getattr(linear, "weight", None), "dtype", None))
        raise ValueError(f"--layers_kernel cpp does not compute a {type(linear).__name__} ({what})")
    kind, tensors, group = found
    bias = getattr(linear, "bias", None)
    return tensors + ([] if bias is None else [bias]), [cpu_layers.KINDS[kind], group, int(bias is not None)]


def _product_kind(linear: nn.Module) -> tuple[str, list[torch.Tensor], int] | None:
    """The kind (:data:`gpt_fast.kernels.cpu_layers.KINDS`), tensors and group size of a product our C++ products
    compute: float32 weights (a linear layer's, or a tied embedding table's), or the ``cpp`` and ``cpp-q8``
    quantized kernels' (a quantized table's too, :class:`gpt_fast.quant.layers.Int8Embedding`); None otherwise."""
    if isinstance(linear, (nn.Linear, nn.Embedding)) and linear.weight.dtype == torch.float32:
        return "float32", [linear.weight], 0
    if isinstance(linear, Int8Linear) and linear.kernel == "cpp-q8":
        return "int8-q8", [linear.words, linear.scales], linear.group_size or 0
    if isinstance(linear, Int8Linear) and linear.kernel == "cpp":
        return "int8", [linear.weight, linear.scales], linear.group_size or 0
    if isinstance(linear, Int4Linear) and linear.kernel == "cpp-q8":
        return "int4-q8", [linear.words, linear.scales, linear.zeros], linear.group_size
    if isinstance(linear, Int4Linear) and linear.kernel == "cpp":
        return "int4", [linear.weight, linear.scales, linear.zeros], linear.group_size
    return None


def cpp_plan(model: Transformer) -> tuple[list[torch.Tensor], list[int]]:
    """Every layer's norm weights and products as :func:`gpt_fast.kernels.cpu_layers.decode_layers` takes them, then,
    where our products compute the output projection, the final norm's weight and that product: the operator then
    returns the logits."""
    weights: list[torch.Tensor] = []
    plan: list[int] = []
    for layer in model.layers:
        attention, mlp = layer.attention, layer.feed_forward
        weights += [layer.attention_norm.weight, layer.ffn_norm.weight]
        for linear in (attention.wqkv, attention.wo, mlp.w13, mlp.w2):
            tensors, numbers = product_plan(linear)
            weights += tensors
            plan += numbers
    head = model.tok_embeddings if model.output is None else model.output
    if _product_kind(head) is not None:
        tensors, numbers = product_plan(head)
        weights += [model.norm.weight, *tensors]
        plan += numbers
    return weights, plan


def cpp_caches_ready(model: Transformer) -> None:
    """Keep the layers' caches in a list for :func:`cpp_layers` (``layers_kernel_caches``: read once per cache
    set-up, not per token; the model drops it before it replaces the caches)."""
    model.layers_kernel_caches = [layer.attention.kv_cache.kv for layer in model.layers]


def cpp_layers(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor, first_row: int) -> torch.Tensor:
    """What :class:`gpt_fast.model.transformer.Transformer` calls as its ``layers_kernel`` on the CPU: the residual
    ``x`` [B, 1, D] after every layer, for the tokens at ``input_pos`` ([1] or [B, 1]) of the cache's rows
    ``first_row`` onwards (static, or paged through the model's block table); or, where :func:`cpp_plan` holds the
    head (``layers_kernel_logits``), the logits [B, 1, V] of its final norm."""
    cfg, first = model.config, model.layers[0].attention
    weights, plan = model.cpp_layers_plan
    shape = [cfg.n_head, cfg.n_local_heads, cfg.head_dim]
    scale = first.scale or cfg.head_dim**-0.5
    table = None if model.block_table is None else model.block_table.blocks
    return cpu_layers.decode_layers(
        x, weights, plan, model.layers_kernel_caches, model.rope_cos, model.rope_sin, input_pos.contiguous(), shape,
        cfg.norm_eps, cfg.norm_offset, scale, first.softcap, cfg.mlp_activation == "gelu_tanh", first_row, table,
        GEMV_ROWS,
    )  # fmt: skip


def use_layers_kernel(model: nn.Module, kernel: str) -> None:
    """Give ``model`` the layers kernel ``kernel`` (a name :func:`resolve_layers_kernel` returned)."""
    if isinstance(model, Transformer) and kernel == "cpp":
        model.cpp_layers_plan = cpp_plan(model)
        model.layers_kernel, model.layers_kernel_eager, model.caches_ready = cpp_layers, True, cpp_caches_ready
        model.layers_kernel_rows = True
        model.layers_kernel_logits = cpu_layers.holds_head(model.cpp_layers_plan[1], len(model.layers))
        if model.max_seq_length:
            cpp_caches_ready(model)
        return
    if isinstance(model, Transformer):
        model.cpp_layers_plan, model.layers_kernel_caches = None, None
        model.layers_kernel_eager = model.layers_kernel_rows = model.layers_kernel_logits = False
        model.layers_kernel = persistent_layers if kernel == "triton" else None
        model.caches_ready = fill_pointer_table if kernel == "triton" else None
        if kernel == "triton":  # allocated here, outside any CUDA graph's memory pool
            table = torch.zeros(len(model.layers), TABLE_COLUMNS, dtype=torch.int64, device=model.norm.weight.device)
            model.register_buffer("layers_table", table, persistent=False)
            if model.max_seq_length:
                fill_pointer_table(model)
