"""What a kernel choice depends on (:class:`Context`) and the rule every choice follows (:func:`choose`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpt_fast.kernels.available import triton_usable
from gpt_fast.model.config import ModelConfig, QuantConfig


@dataclass(frozen=True)
class Context:
    """Where the kernels run: the device, the compile mode of the decode steps, the model's config and quantization,
    the engine options that rule kernels out (regional compilation, batch-invariant steps, tensor parallelism), the
    model's dtype (None: not known), the KV cache's (None: the model's) and the quantized products' kernel as
    resolved (:func:`gpt_fast.accel.registry.resolve_kernels` fills it in)."""

    device: torch.device
    compile_mode: str
    config: ModelConfig
    quantization: QuantConfig | None = None
    regional_compile: bool = False
    batch_invariant: bool = False
    tensor_parallel: bool = False
    dtype: torch.dtype | None = None
    quant_kernel: str | None = None
    kv_dtype: torch.dtype | None = None

    @property
    def cache_of_its_own(self) -> torch.dtype | None:
        """The KV cache's dtype where it is not the model's (a kernel reading the cache must read that dtype),
        else None."""
        return self.kv_dtype if self.kv_dtype not in (None, self.dtype) else None


def choose(
    kernel: str, choices: tuple[str, ...], what: str, device: torch.device, auto: str, register: Callable[[], None]
) -> str:
    """The kernel a ``what`` (e.g. "attention kernel") computes with: ``kernel``, or ``auto`` where it is ``auto``.
    Refuses a ``kernel`` that is not one of ``choices``, or ``triton`` where
    :func:`gpt_fast.kernels.available.triton_usable` says no; a ``triton`` choice calls ``register`` (its operators'
    registration) before anything is compiled."""
    if kernel not in choices:
        raise ValueError(f"{what} {kernel!r} is not one of {', '.join(choices)}")
    if kernel == "triton" and not triton_usable(device):
        raise ValueError(f"the triton {what} needs a CUDA GPU with Triton installed, not {device}")
    chosen = auto if kernel == "auto" else kernel
    if chosen == "triton":
        register()
    return chosen
