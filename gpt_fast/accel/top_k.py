"""Top-k sampling of a decode step's logits: ``torch.topk`` and softmax, or our two Triton kernels.

- ``torch``: :func:`gpt_fast.generation.sampling.sample` as it is: ``torch.topk`` (a radix select of about sixteen small
  kernels on a GPU), the softmax and the exponential race over the k candidates.
- ``triton``: :mod:`gpt_fast.kernels.triton_top_k`, a histogram of the logits' 16-bit keys and the race over the
  candidates in two kernels of many programs each, registered as the opaque operator ``gpt_fast::top_k_sample``
  (it launches itself, with PDL in the CUDA-graph modes where the device has it). On an H200 (BENCHMARKS.md,
  twenty-eighth session, one row, k = 200, in a CUDA graph, the noise draw included): 20.6 µs against 44.3 for
  32000 logits, 16.9 against 50.7 for 49152, 49.5 against 61.4 for 128256.

It samples from the same distribution as ``torch`` with other draws: one Exp(1) draw per vocabulary id rather than
per candidate, and of logits tied at the k-th largest the lowest ids are the candidates (``torch.topk`` leaves that
order unspecified). It serves 16-bit logits under top-k without top-p, with ``k`` below the vocabulary size; any
other setting keeps the PyTorch code. ``auto`` takes it where it takes our GEMV: in the CUDA-graph modes on GPUs
that launch with PDL (BENCHMARKS.md, twenty-eighth session, heuristic tuning: SmolLM2 shape 1727.1 tok/s against
1603.0, Llama-2-7B 281.5 against 280.2).
"""

from __future__ import annotations

import functools

import torch

from gpt_fast.accel.linear import pdl_kernels_measured
from gpt_fast.model.transformer import Transformer
from gpt_fast.quant.products import resolve_kernel_choice
from gpt_fast.util.choices import SAMPLING_KERNELS


def resolve_sampling_kernel(kernel: str, device: torch.device, compile_mode: str) -> str:
    """``auto``: ``triton`` where our GEMV is taken (:func:`gpt_fast.accel.linear.pdl_kernels_measured`: the
    CUDA-graph modes on GPUs that launch with PDL), elsewhere ``torch``. ``triton`` needs a CUDA GPU with Triton;
    choosing it registers its operator (:func:`register_triton_ops`) before anything is compiled."""
    auto = "triton" if pdl_kernels_measured(device, compile_mode) else "torch"
    return resolve_kernel_choice(kernel, SAMPLING_KERNELS, "sampling kernel", device, auto, register_triton_ops)


@functools.cache
def register_triton_ops() -> None:
    """Register the kernels as the operator ``torch.ops.gpt_fast.top_k_sample``, eagerly: ``torch.compile`` cannot
    trace a registration (see :func:`gpt_fast.quant.products.register_triton_ops`). Nothing happens at import."""
    from gpt_fast.kernels import triton_top_k

    @torch.library.custom_op("gpt_fast::top_k_sample", mutates_args=())
    def top_k_sample(logits: torch.Tensor, noise: torch.Tensor, top_k: int, temperature: float) -> torch.Tensor:
        pdl = torch.cuda.is_current_stream_capturing()  # PDL pays inside CUDA graphs, not launched from Python
        return triton_top_k.top_k_sample(logits.contiguous(), noise.contiguous(), top_k, temperature, pdl)

    @top_k_sample.register_fake
    def _(logits: torch.Tensor, noise: torch.Tensor, top_k: int, temperature: float) -> torch.Tensor:
        return logits.new_empty(logits.shape[0], dtype=torch.int64)


def triton_top_k(logits: torch.Tensor, noise: torch.Tensor, top_k: int, temperature: float) -> torch.Tensor:
    """The operator (registered by :func:`resolve_sampling_kernel`) as a
    ``gpt_fast.generation.sampling.TopKSampler``."""
    return torch.ops.gpt_fast.top_k_sample(logits, noise, top_k, temperature)


def use_sampling_kernel(model: Transformer, kernel: str) -> None:
    """Give ``model``'s decode steps the sampling kernel ``kernel`` (a name :func:`resolve_sampling_kernel`
    returned), as :attr:`gpt_fast.model.transformer.Transformer.top_k_sampler`."""
    model.top_k_sampler = triton_top_k if kernel == "triton" else None
