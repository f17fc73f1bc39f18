"""The decoder layers' unquantized linear layers in a decode step of one sequence: cuBLAS or inductor, or our GEMV.

- ``torch``: the model's ``nn.Linear`` (inductor turns a one-row product into its own reduction, or calls cuBLAS).
- ``triton``: :mod:`gpt_fast.kernels.triton_linear`, a GEMV launched with programmatic dependent launch, whose
  weight loads begin while the kernel before it drains. It is registered as the opaque operator
  ``gpt_fast::linear_gemv`` (``torch.library.custom_op``, not ``triton_op``): inductor launches the kernels of a
  ``triton_op`` itself, without PDL. On an H200, Llama-2-7B shape, one machine (BENCHMARKS.md, twentieth session):
  245.6 tok/s against 217.2 with inductor's heuristic configurations (the kernel without PDL: 239.5-241.8), 244.1
  against 241.1 with coordinate-descent tuning (whose builds spread more); Llama-3-8B shape 224.5 against 203.7.

A gated MLP's ``w13`` and its activation are one kernel, ``gpt_fast::gated_gemv`` (set as
:attr:`gpt_fast.model.transformer.FeedForward.gated_kernel`), so that the activation is no kernel of its own: on the
same H200,
7B shape 249.3 -> 258.9 tok/s (twenty-first session).

In a layer :func:`fuses_row` takes, the norms and residual adds are no kernels of their own either
(:class:`FusedRow`, set as :attr:`gpt_fast.model.transformer.TransformerBlock.row_kernels`): each norm is computed
inside the GEMV after it, each residual add inside the GEMV before it. A layer's products may be quantized
(:meth:`gpt_fast.quant.layers.QuantizedLinear.row`: our int8 and int4 kernels with the same neighbours inside).
The figures behind these choices are in BENCHMARKS.md and docs/bench/HISTORY.md.

``auto`` takes the kernel in the CUDA-graph compile modes (where PDL applies) on CUDA GPUs of compute capability 9
or more with Triton, on one GPU or split over several (each rank's shards;
:class:`gpt_fast.parallel.tensor_parallel.ParallelRow`); elsewhere the model's code. Small models take it too
since the norms moved inside it: SmolLM2-135M shape 1572-1624 tok/s against 1235-1332, int8 1392 against 1077, int4
1214 against 894 (twenty-eighth session). The model calls the kernel only in compiled steps with one row of
activations (batch 1, one position); prefills, batches and eager steps keep ``nn.Linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from gpt_fast.model.transformer import FeedForward, RMSNorm, Transformer, TransformerBlock
from gpt_fast.quant.layers import QuantizedLinear
from gpt_fast.quant.products import resolve_kernel_choice, triton_usable
from gpt_fast.util.choices import LINEAR_KERNELS

PDL_MODES = ("reduce-overhead", "max-autotune")  # the compile modes that run decode steps in CUDA graphs


def resolve_linear_kernel(kernel: str, device: torch.device, compile_mode: str) -> str:
    """``auto``: see the module. Choosing Triton registers its operator (:func:`register_triton_ops`), before
    anything is compiled."""
    auto = "triton" if pdl_kernels_measured(device, compile_mode) else "torch"
    return resolve_kernel_choice(kernel, LINEAR_KERNELS, "linear kernel", device, auto, register_triton_ops)


def pdl_kernels_measured(device: torch.device, compile_mode: str) -> bool:
    """Where our decode kernels launched with PDL were measured faster than the model's code (``auto``'s choice of
    this GEMV, of :mod:`gpt_fast.accel.decode_attention`'s kernel and of :mod:`gpt_fast.accel.top_k`'s): the
    CUDA-graph modes on a GPU that launches with PDL (:func:`steps_with_pdl`), with or without ``--aot_precompile``
    (a package calls the registered operators by name; the engine registers them before it loads one), on one GPU
    or split over several (Llama-2-7B shape on two H200s: 322.9 tok/s with the GEMV and the attention against
    284.3 without; BENCHMARKS.md, twenty-ninth session)."""
    return steps_with_pdl(device, compile_mode)


def steps_with_pdl(device: torch.device, compile_mode: str) -> bool:
    """Whether decode steps run in CUDA graphs on a GPU whose kernels launch with PDL."""
    if compile_mode not in PDL_MODES or not triton_usable(device):
        return False
    from gpt_fast.kernels.pdl import pdl_usable

    return pdl_usable(device)


@functools.cache
def register_triton_ops() -> None:
    """Register the kernel as the operator ``torch.ops.gpt_fast.linear_gemv``, eagerly: ``torch.compile`` cannot
    trace a registration (see :func:`gpt_fast.quant.products.register_triton_ops`). Nothing happens at import."""
    from gpt_fast.kernels import triton_linear

    @torch.library.custom_op("gpt_fast::linear_gemv", mutates_args=())
    def linear_gemv(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        return triton_linear.linear_gemv(x, weight, bias, residual, norm_weight, eps)

    @linear_gemv.register_fake
    def _(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.custom_op("gpt_fast::gated_gemv", mutates_args=())
    def gated_gemv(
        x: torch.Tensor, weight: torch.Tensor, activation: str, norm_weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        return triton_linear.gated_gemv(x, weight, activation, norm_weight, eps)

    @gated_gemv.register_fake
    def _(
        x: torch.Tensor, weight: torch.Tensor, activation: str, norm_weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0] // 2))


class DecodeLinear(nn.Linear):
    """An ``nn.Linear`` (the same parameters) whose compiled one-row products call ``gpt_fast::linear_gemv``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1] and torch.compiler.is_compiling():  # one row: batch 1, one position
            return FusedRow.linear(x, self)
        return F.linear(x, self.weight, self.bias)

    def fuses_row(self) -> bool:
        return True

    def row(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        activation: str | None = None,
    ) -> torch.Tensor:
        """As :meth:`gpt_fast.quant.layers.QuantizedLinear.row`: ``gpt_fast::linear_gemv``, or for a gated MLP's
        ``w13`` ``gpt_fast::gated_gemv``."""
        if activation is not None:
            return torch.ops.gpt_fast.gated_gemv(x, self.weight, activation, norm_weight, eps)
        return torch.ops.gpt_fast.linear_gemv(x, self.weight, self.bias, residual, norm_weight, eps)


class FusedRow:
    """The products of one row ``x`` [..., K] each as one kernel of ours (a product's ``row``: ``linear_gemv`` and
    ``gated_gemv`` for :class:`DecodeLinear`, ``int8_row`` and ``int4_row`` for a quantized layer that
    :meth:`gpt_fast.quant.layers.QuantizedLinear.fuses_row`): what :class:`DecodeLinear` calls,
    :attr:`gpt_fast.model.transformer.FeedForward.gated_kernel` (:meth:`gated`, ``w13`` and the activation in one
    kernel) and
    :attr:`gpt_fast.model.transformer.TransformerBlock.row_kernels` (with the norm before a product and the residual
    add after
    it inside the kernel, so that neither is a kernel of its own: on an H200, Llama-2-7B shape, each norm was a
    kernel of about 2 µs between two GEMVs, during which no weights streamed; BENCHMARKS.md, twenty-sixth and
    twenty-seventh sessions)."""

    @staticmethod
    def linear(
        x: torch.Tensor,
        linear: nn.Module,
        residual: torch.Tensor | None = None,
        norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """``linear`` of ``x`` (normed by ``norm``), plus ``residual`` [..., N]: [..., N]."""
        added = None if residual is None else residual.reshape(1, -1).contiguous()
        y = linear.row(x.reshape(1, -1).contiguous(), added, *norm_operands(norm))
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def gated(x: torch.Tensor, w13: nn.Module, activation: str, norm: RMSNorm | None = None) -> torch.Tensor:
        """A gated MLP's hidden state [..., I] of ``x`` (normed by ``norm``) and its ``w13`` (gate rows, then up
        rows)."""
        y = w13.row(x.reshape(1, -1).contiguous(), None, *norm_operands(norm), activation)
        return y.view(*x.shape[:-1], y.shape[-1])


def norm_operands(norm: RMSNorm | None) -> tuple[torch.Tensor | None, float]:
    """The operators' ``norm_weight`` and ``eps`` for ``norm`` (None: no norm inside)."""
    return (None, 0.0) if norm is None else (norm.weight, norm.eps)


def computes_row(product: nn.Module) -> bool:
    """Whether :class:`FusedRow` computes ``product``'s one-row products: swapped, or quantized and computed by our
    kernel on 16-bit activations."""
    return isinstance(product, (DecodeLinear, QuantizedLinear)) and product.fuses_row()


def fuses_row(block: TransformerBlock) -> bool:
    """Whether :meth:`gpt_fast.model.transformer.TransformerBlock.one_row` computes ``block``: a gated MLP, no
    post-norms, four
    products :func:`computes_row` takes, norms without an offset and without a kernel of their own."""
    attention, mlp = block.attention, block.feed_forward
    if not isinstance(mlp, FeedForward) or block.post_attention_norm is not None:
        return False
    products = (attention.wqkv, attention.wo, mlp.w13, mlp.w2)
    norms = (block.attention_norm, block.ffn_norm)
    return all(map(computes_row, products)) and all(n.offset == 0 and n.kernel is None for n in norms)


def swap_linears(root: nn.Module, cls: type[nn.Linear]) -> None:
    """Replace every plain ``nn.Linear`` inside ``root`` with a ``cls`` sharing its parameters."""
    for module in list(root.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                swapped = cls(child.in_features, child.out_features, child.bias is not None, device="meta")
                swapped.weight, swapped.bias = child.weight, child.bias
                setattr(module, name, swapped)


def use_linear_kernel(model: Transformer, kernel: str) -> None:
    """Give the linear layers of ``model``'s decoder layers the kernel ``kernel`` (a name
    :func:`resolve_linear_kernel` returned): ``triton``, :class:`DecodeLinear`, to each gated MLP whose ``w13``
    :func:`computes_row` takes, :meth:`FusedRow.gated`, and to each layer :func:`fuses_row` takes,
    :class:`FusedRow`; ``torch``, none (``nn.Linear``). Quantized layers keep their kernels, and where
    :class:`FusedRow` computes a layer it computes their one-row products with their neighbours inside too
    (:func:`gpt_fast.quant.layers.launch_with_pdl` gives them PDL where this kernel is ``triton``); the output
    head keeps its kernel."""
    if kernel == "triton":
        swap_linears(model.layers, DecodeLinear)
        for module in model.layers.modules():
            if isinstance(module, FeedForward) and computes_row(module.w13):
                module.gated_kernel = FusedRow.gated
        for block in model.layers:
            block.row_kernels = FusedRow if fuses_row(block) else None
