"""The attention of a decode step (one query position per row) as one fused kernel, or the model's PyTorch code.

- ``triton``: :mod:`gpt_fast.kernels.triton_decode_attention`, on CUDA GPUs: rotary embedding of the step's query
  and key, the cache write and the attention over the positions seen, in one kernel per layer (a second, small one
  combines the splits of a long cache), where inductor makes six of the PyTorch code. Over the static cache and the
  paged one (given its block table). Wrapped as the ``torch.library.triton_op`` ``gpt_fast::decode_attention`` (it
  mutates the cache), so that ``torch.compile`` places it in its own generated code and CUDA graphs capture it.
- ``cpp``: :mod:`gpt_fast.kernels.cpu_attention`, on an x86 CPU that builds our C++ kernels: the same in one C++
  operator per layer, ``gpt_fast::decode_attention_cpu``, which reads the positions up to the query's where the
  compiled PyTorch code reads the whole cache.
- ``torch``: the model's own code (:func:`gpt_fast.model.transformer.apply_rope`,
  :meth:`gpt_fast.model.cache.KVCache.update`, :func:`gpt_fast.model.transformer.attend_one_query`): runs
  everywhere, ROCm and the CPU included.

The model calls the kernel only in compiled decode steps: eager steps keep PyTorch's SDPA, which
:func:`gpt_fast.model.transformer.attend_one_query`'s docstring explains, and which makes eager decoding an independent
reference for the compiled modes' greedy tokens.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from gpt_fast.accel.choice import choose
from gpt_fast.accel.linear import pdl_kernels_measured, steps_with_pdl
from gpt_fast.accel.options import ATTENTION_KERNELS, check_regional_compile
from gpt_fast.kernels import cpu_attention, cpu_gemv
from gpt_fast.model.transformer import Attention
from gpt_fast.quant.products import cpp_usable


def resolve_attention_kernel(
    kernel: str,
    device: torch.device,
    compile_mode: str,
    *,
    regional_compile: bool = False,
    cache_dtype: torch.dtype | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """``auto``: the fused kernel where our GEMV is taken (:func:`gpt_fast.accel.linear.pdl_kernels_measured`),
    and so launched with PDL (:func:`attention_pdl`), but not with ``regional_compile`` (see
    :func:`check_regional_compile`); elsewhere the PyTorch code. On an H200, with our GEMVs and
    sampling kernel, heuristic tuning, one machine (docs/bench/HISTORY.md, 2026-11-25a): SmolLM2 1822 tok/s with it
    against 1576 with inductor's attention, Llama-3-8B 244.0 against 237.0; Llama-2-7B 271.1 against 258.9
    (docs/bench/HISTORY.md, 2026-11-24c). GQA models of few kv heads gain through the kernel's short splits
    (:func:`gpt_fast.kernels.triton_decode_attention.decode_launch`), without which it is slower for them. Choosing
    Triton (a CUDA GPU with Triton installed, not ROCm) registers its operators (:func:`register_triton_ops`), before
    anything is compiled. ``cache_dtype``: the KV cache's where it is not the model's ``dtype``. The Triton kernel
    widens any cache's keys and values to float32 as it loads them (a float8 cache's too); the C++ one reads a
    float16, bfloat16 or float8_e4m3fn cache below a float32 model only (``auto`` takes the PyTorch code
    elsewhere)."""
    check_regional_compile(kernel, regional_compile)
    if kernel == "cpp" or (kernel == "auto" and device.type == "cpu"):
        if cache_dtype is not None and (dtype != torch.float32 or cache_dtype not in cpu_attention.NARROWER_CACHES):
            return _refuse_cache_dtype(kernel, cache_dtype, dtype)
        return _resolve_cpp(kernel, device, compile_mode, regional_compile)
    measured = pdl_kernels_measured(device, compile_mode)
    auto = "triton" if measured and not regional_compile else "torch"
    return choose(kernel, ATTENTION_KERNELS, "attention kernel", device, auto, register_triton_ops)


def _refuse_cache_dtype(kernel: str, cache_dtype: torch.dtype, dtype: torch.dtype | None) -> str:
    """``torch`` for ``auto`` or ``torch``, where a fused kernel does not read a ``cache_dtype`` cache of a
    ``dtype`` model; a fused kernel asked for is refused."""
    if kernel in ("auto", "torch"):
        return "torch"
    raise ValueError(f"the {kernel} attention kernel does not read a {cache_dtype} KV cache of a {dtype} model")


def _resolve_cpp(kernel: str, device: torch.device, compile_mode: str, regional_compile: bool) -> str:
    """``cpp`` where it runs (refused elsewhere); ``auto`` on the CPU: ``cpp`` in compiled steps where the kernels
    build, without ``regional_compile``. One layer of the default model's shape, a query at position 70 of a
    192-position cache, one thread: 9.2 µs against 22.7 for inductor's code of the model's attention (docs/cpu.md,
    "Where a token's time goes")."""
    usable = cpp_usable(device)
    if kernel == "cpp" and not usable:
        raise ValueError(f"the cpp attention kernel needs an x86 CPU with AVX2, a C++ compiler and ninja, not {device}")
    if kernel == "auto" and (not usable or compile_mode == "none" or regional_compile):
        return "torch"
    return "cpp"


def load_attention_kernel(kernel: str) -> None:
    """Build and load what the chosen ``kernel`` needs before the weights are read: our C++ library for ``cpp``
    (:func:`register_cpp_ops`; some 20 s the first time on a machine), after every check that needs no weights."""
    if kernel == "cpp":
        register_cpp_ops()


@functools.cache
def register_cpp_ops() -> None:
    """Build and load our C++ kernels (:func:`gpt_fast.kernels.cpu_gemv.load_cpu_kernels`) and give
    ``gpt_fast::decode_attention_cpu`` its shape function for ``torch.compile`` (:func:`load_attention_kernel`)."""
    cpu_gemv.load_cpu_kernels()
    torch.library.register_fake("gpt_fast::decode_attention_cpu", lambda q, *_args: q.new_empty(q.shape))


def attention_pdl(kernel: str, device: torch.device, compile_mode: str) -> bool:
    """Whether the kernel ``kernel`` (a name :func:`resolve_attention_kernel` returned) is the fused one launched
    with PDL (``gpt_fast::decode_attention_pdl``, an opaque ``custom_op`` that launches its kernels itself): in
    decode steps in CUDA graphs on GPUs that launch with PDL (:func:`gpt_fast.accel.linear.steps_with_pdl`).
    Elsewhere the fused kernel is ``gpt_fast::decode_attention``, which inductor launches without PDL."""
    return kernel == "triton" and steps_with_pdl(device, compile_mode)


@functools.cache
def register_triton_ops() -> None:
    """Register the kernel as the operators ``torch.ops.gpt_fast.decode_attention`` and ``decode_attention_pdl``,
    eagerly: ``torch.compile`` cannot trace a registration (see :func:`gpt_fast.quant.products.register_triton_ops`).
    Nothing happens at import."""
    from torch.library import triton_op, wrap_triton

    from gpt_fast.kernels import triton_decode_attention

    def decode_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        input_pos: torch.Tensor,
        first_row: int,
        scale: float,
        softcap: float | None,
        window: int | None,
        table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return triton_decode_attention.decode_attention(
            q, k, v, cos, sin, kv, input_pos, first_row, scale, softcap, window, table, wrap=wrap_triton
        )

    def decode_attention_pdl(*args: object) -> torch.Tensor:
        return triton_decode_attention.decode_attention(*args, pdl=True)

    triton_op("gpt_fast::decode_attention", decode_attention, mutates_args=("kv",))
    schema = torch.library.infer_schema(decode_attention, mutates_args=("kv",))  # the same arguments
    pdl = torch.library.custom_op(
        "gpt_fast::decode_attention_pdl", decode_attention_pdl, mutates_args=("kv",), schema=schema
    )
    pdl.register_fake(lambda q, *_args: q.new_empty(q.shape))


def fused_decode_attention(*args: object) -> torch.Tensor:
    """What :class:`gpt_fast.model.transformer.Attention` calls as its ``decode_kernel``: the operator, with the
    arguments of :func:`gpt_fast.kernels.triton_decode_attention.decode_attention` (but ``launch``, ``wrap`` and
    ``pdl``): a paged cache's block table last, None for a static cache."""
    return torch.ops.gpt_fast.decode_attention(*args)


def fused_decode_attention_pdl(*args: object) -> torch.Tensor:
    """:func:`fused_decode_attention` launched with PDL (:mod:`gpt_fast.kernels.pdl`)."""
    return torch.ops.gpt_fast.decode_attention_pdl(*args)


def use_attention_kernel(model: nn.Module, kernel: str, pdl: bool = False) -> None:
    """Give every attention layer of ``model`` the decode kernel ``kernel`` (a name :func:`resolve_attention_kernel`
    returned): ``triton``, the fused kernel (launched with PDL with ``pdl``: see :func:`attention_pdl`); ``cpp``,
    the C++ one; ``torch``, none (the model's PyTorch code)."""
    fused = {
        "triton": fused_decode_attention_pdl if pdl else fused_decode_attention,
        "cpp": cpu_attention.decode_attention,
    }.get(kernel)
    for module in model.modules():
        if isinstance(module, Attention):
            module.decode_kernel = fused
