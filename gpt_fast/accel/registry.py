"""The one registry of fast paths: for each operation of :class:`gpt_fast.accel.options.KernelOptions`, how its
choice is resolved on a device (``auto`` made concrete, a choice that cannot run there refused, Triton's operators
registered), what the chosen kernel needs built before the weights are read (our C++ library), and how it is
installed into a built model. The engine resolves every choice when it opens a checkpoint (:func:`resolve_kernels`),
builds what they need as it starts reading the weights (:func:`load_kernels`: the C++ library takes some 20 s the
first time on a machine, so a mistake that a command finds after opening is reported before that) and installs them
once the weights are loaded (:func:`install_kernels`); the model imports none of this.

A quantized checkpoint's products are chosen here too, and applied by the loader: a layer's weights are repacked
for its kernel as they are read (:func:`gpt_fast.quant.layers.prepare_quantized`, which loads our C++ library
where the kernel is ours on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from gpt_fast.accel import decode_attention, gated_activation, linear, persistent, top_k
from gpt_fast.accel.choice import Context
from gpt_fast.accel.options import KernelOptions
from gpt_fast.model.transformer import Transformer
from gpt_fast.quant.layers import launch_with_pdl
from gpt_fast.quant.products import resolve_kernel


@dataclass(frozen=True)
class FastPath:
    """One operation's fast path: ``resolve`` makes the option's value concrete for a :class:`Context`;
    ``load`` builds and loads what the chosen kernel needs before the weights are read; ``install`` gives a built
    model the chosen kernel."""

    name: str  # the KernelOptions field
    resolve: Callable[[str, Context], str]
    install: Callable[[Transformer, str, Context], None]
    load: Callable[[str], None] = lambda _kernel: None


@dataclass(frozen=True)
class ChosenKernels:
    """Each operation's kernel as resolved on the engine's device: never ``auto``, but for the products of a model
    that has no quantized layers."""

    quant: str
    attention: str
    activation: str
    layers: str
    linear: str
    sampling: str


def _resolve_quant(kernel: str, context: Context) -> str:
    if context.quantization is None:  # no quantized layers: nothing computes with it
        return kernel
    return resolve_kernel(kernel, context.device)


def _install_at_load(model: Transformer, kernel: str, context: Context) -> None:
    """Nothing to install: the loader builds the quantized layers with their kernel."""


def _resolve_attention(kernel: str, context: Context) -> str:
    if context.batch_invariant:  # batch-invariant steps attend with their own operator (Attention.rows_kernel)
        return "torch"
    return decode_attention.resolve_attention_kernel(
        kernel,
        context.device,
        context.compile_mode,
        regional_compile=context.regional_compile,
        cache_dtype=context.cache_of_its_own,
        dtype=context.dtype,
    )


def _install_attention(model: Transformer, kernel: str, context: Context) -> None:
    pdl = decode_attention.attention_pdl(kernel, context.device, context.compile_mode)
    decode_attention.use_attention_kernel(model, kernel, pdl)


def _resolve_activation(kernel: str, context: Context) -> str:
    if context.batch_invariant:  # the same elementwise code for any number of rows
        return "torch"
    return gated_activation.resolve_activation_kernel(kernel, context.device, context.config)


def _resolve_layers(kernel: str, context: Context) -> str:
    chosen = persistent.resolve_layers_kernel(kernel, context)
    if chosen == "triton":
        persistent.check_layers_kernel(context.config, context.quantization, persistent.programs_for(context.device))
    return chosen


def _resolve_linear(kernel: str, context: Context) -> str:
    if context.batch_invariant:  # batch-invariant steps have linear layers of their own
        return "torch"
    return linear.resolve_linear_kernel(kernel, context.device, context.compile_mode)


def _install_linear(model: Transformer, kernel: str, context: Context) -> None:
    linear.use_linear_kernel(model, kernel)
    launch_with_pdl(model.layers, kernel == "triton")  # the quantized products beside our GEMVs launch with PDL


def _resolve_sampling(kernel: str, context: Context) -> str:
    return top_k.resolve_sampling_kernel(kernel, context.device, context.compile_mode)


REGISTRY = (
    FastPath("quant", _resolve_quant, _install_at_load),  # prepare_quantized loads its kernel
    FastPath("attention", _resolve_attention, _install_attention, decode_attention.load_attention_kernel),
    FastPath("activation", _resolve_activation, lambda m, k, _c: gated_activation.use_activation_kernel(m, k)),
    FastPath(
        "layers", _resolve_layers, lambda m, k, _c: persistent.use_layers_kernel(m, k), persistent.load_layers_kernel
    ),
    FastPath("linear", _resolve_linear, _install_linear),
    FastPath("sampling", _resolve_sampling, lambda m, k, _c: top_k.use_sampling_kernel(m, k)),
)
assert [path.name for path in REGISTRY] == [f.name for f in fields(KernelOptions)]


def resolve_one(name: str, choice: str, context: Context) -> str:
    """One operation's kernel (``name``: a :class:`KernelOptions` field) for ``choice`` on ``context``'s device."""
    (path,) = [path for path in REGISTRY if path.name == name]
    return path.resolve(choice, context)


def resolve_kernels(options: KernelOptions, context: Context) -> ChosenKernels:
    """Every operation's kernel on ``context``'s device, in the registry's order (refusing a choice that cannot
    run there, registering our Triton operators; nothing is built). The quantized products' kernel comes first:
    the others' choices may depend on it (``context.quant_kernel``)."""
    chosen: dict[str, str] = {}
    for path in REGISTRY:
        chosen[path.name] = path.resolve(getattr(options, path.name), context)
        if path.name == "quant":
            context = replace(context, quant_kernel=chosen["quant"])
    return ChosenKernels(**chosen)


def load_kernels(chosen: ChosenKernels) -> None:
    """Build and load what the chosen kernels need, before the weights are read and anything is compiled."""
    for path in REGISTRY:
        path.load(getattr(chosen, path.name))


def install_kernels(model: Transformer, chosen: ChosenKernels, context: Context) -> None:
    """Give ``model`` every chosen kernel, in the registry's order, and a paged cache the layout they read: heads
    first in each block where our C++ attention reads it (:class:`gpt_fast.model.cache.PagedKVCache`)."""
    for path in REGISTRY:
        path.install(model, getattr(chosen, path.name), context)
    model.paged_heads_major = "cpp" in (chosen.attention, chosen.layers)
