"""Programmatic dependent launch (PDL) for our own Triton kernels: the decode step's GEMVs and attention
(:mod:`gpt_fast.kernels`) and the quantized GEMVs (:mod:`gpt_fast.kernels.triton_gemv`), which is why it sits beside
both rather than in either.

In a CUDA graph, a kernel launched with PDL is scheduled while the kernel before it drains, and waits
(``griddepcontrol.wait``) only where it needs that kernel's results. A decode step's GEMV needs the previous kernel's
output for its activations only: its weights are constant, so each program loads its first tile of weights
*before* the wait, and a GEMV's start overlaps the small kernel before it. Inductor launches its own kernels this
way in the CUDA-graph modes (:func:`gpt_fast.generation.decode.compile_options`) but not kernels it did not generate.

The rule that keeps this safe next to inductor's kernels: a kernel lets its dependents start
(``griddepcontrol.launch_dependents``) only after its own wait. Inductor's kernels skip the wait when they do not
read the previous kernel's output, which is only right if every kernel before that one has finished.

Also how a launcher is handed ``torch.library.wrap_triton`` inside a ``triton_op`` (:data:`Wrap`), or nothing
(:func:`unwrapped`) when called directly, for the same kernels.

Imported only where Triton is; on GPUs before compute capability 9, and on ROCm, the kernels are launched without
it and the instructions are compiled out (``PDL`` is a compile-time constant).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

PDL_CAPABILITY = 9  # griddepcontrol is an sm_90 instruction
NO_PDL: dict[str, Any] = {"PDL": False}  # the launch keywords of a kernel launched without PDL
Wrap = Callable[[Callable[..., None]], Callable[..., None]]  # torch.library.wrap_triton inside a triton_op


def unwrapped(kernel: Callable[..., None]) -> Callable[..., None]:
    """A kernel launched as it is (outside a ``triton_op``)."""
    return kernel


def pdl_usable(device: torch.device) -> bool:
    """Whether kernels on ``device`` can be launched with PDL: a CUDA GPU of compute capability 9 or more."""
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device)[0] >= PDL_CAPABILITY
    )


def pdl_launch(device: torch.device, wanted: bool = True) -> dict[str, Any]:
    """A Triton launch's keyword arguments for a kernel taking the constant ``PDL``: with PDL where ``wanted`` and
    usable."""
    if wanted and pdl_usable(device):
        return {"PDL": True, "launch_pdl": True}
    return NO_PDL


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the kernel before this one has finished and its writes are visible (a no-op without PDL), then
    let the next kernel be scheduled (see the module's rule)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
