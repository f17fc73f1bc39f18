"""Which kernel serves each operation of a decode step: :class:`KernelOptions`, one nested, self-validating options
object of :class:`gpt_fast.engine.engine.EngineOptions`. Imports no torch, so that the command line lists the
choices without loading it; :mod:`gpt_fast.accel.registry` resolves ``auto`` per device and installs the choice."""

from __future__ import annotations

from dataclasses import dataclass, fields

from gpt_fast.model.config import QUANT_KERNELS
from gpt_fast.util.options import OptionError, check_one_of

TRITON_OR_TORCH = ("auto", "triton", "torch")  # our Triton kernel, or the model's PyTorch code
ACTIVATION_KERNELS = LINEAR_KERNELS = SAMPLING_KERNELS = TRITON_OR_TORCH
ATTENTION_KERNELS = LAYERS_KERNELS = ("auto", "triton", "cpp", "torch")  # cpp: our C++ kernel on an x86 CPU


@dataclass(frozen=True)
class KernelOptions:
    """The kernel of each operation; ``auto`` lets :mod:`gpt_fast.accel.registry` choose for the device and
    compile mode (docs/performance.md says where each one pays).

    - ``quant``: a quantized checkpoint's products (``triton``, ``gemlite``: with gemlite's kernels for an int8
      batched step, ``cpp``, ``aten``: PyTorch's weight-only kernels, ``dequant``: dequantize then ``F.linear``),
      :mod:`gpt_fast.quant.products`;
    - ``attention``: a compiled decode step's fused attention, :mod:`gpt_fast.accel.decode_attention`;
    - ``activation``: a gated MLP's activation in a compiled decode step, :mod:`gpt_fast.accel.gated_activation`;
    - ``layers``: every layer of a one-token step in one kernel (a persistent Triton kernel, or one C++ operator on
      the CPU), :mod:`gpt_fast.accel.persistent`;
    - ``linear``: the decoder layers' unquantized products of a one-row step, :mod:`gpt_fast.accel.linear`;
    - ``sampling``: top-k sampling of a decode step's logits, :mod:`gpt_fast.accel.top_k`.
    """

    quant: str = "auto"
    attention: str = "auto"
    activation: str = "auto"
    layers: str = "auto"
    linear: str = "auto"
    sampling: str = "auto"

    def __post_init__(self) -> None:
        for name, choices in KERNEL_CHOICES.items():
            check_one_of(f"kernels.{name}", getattr(self, name), choices)

    def asked_for(self, choice: str) -> tuple[str, ...]:
        """The operations set to ``choice`` (``triton``: the ones that must run our kernels)."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) == choice)


KERNEL_CHOICES = {
    "quant": QUANT_KERNELS,
    "attention": ATTENTION_KERNELS,
    "activation": ACTIVATION_KERNELS,
    "layers": LAYERS_KERNELS,
    "linear": LINEAR_KERNELS,
    "sampling": SAMPLING_KERNELS,
}


def check_regional_compile(kernel: str, regional_compile: bool) -> None:
    """Refuse the fused kernel with regional compilation: the kernel writes the cache, and PyTorch cannot yet
    compile an operator that mutates its input inside a reused region (``torch.compiler.nested_compile_region``
    raises "Found a custom (non-ATen) operator whose output has alias annotations", pytorch/pytorch#186807; seen
    with torch 2.11 on an H200 and 2.13 on the CPU)."""
    if kernel in ("triton", "cpp") and regional_compile:
        message = f"regional_compile does not combine with the {kernel} attention kernel yet"
        raise OptionError(message, "regional_compile")
