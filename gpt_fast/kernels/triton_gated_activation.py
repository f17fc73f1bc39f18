"""Triton kernel for a gated MLP's hidden state in a decode step: ``act(gate) * up`` from ``w13``'s output.

Rounding follows the PyTorch code (:func:`gpt_fast.kernels.row.gated`).

Imported only where Triton is (:mod:`gpt_fast.accel.gated_activation` decides); the launcher runs on CUDA tensors,
and in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpt_fast.kernels.pdl import Wrap, unwrapped
from gpt_fast.kernels.row import ACTIVATIONS, gated

BLOCK = 1024  # hidden units per program


@triton.jit
def _gated_activation(gate_up_ptr, out_ptr, hidden, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``program_id(0)``'s units ``program_id(1) * BLOCK ...``: gate at ``[row, i]``, up at ``[row, hidden + i]``
    of ``gate_up`` [rows, 2 * hidden]; out [rows, hidden]."""
    row = tl.program_id(0).to(tl.int64)
    units = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = units < hidden
    gate = tl.load(gate_up_ptr + row * 2 * hidden + units, inside).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * hidden + hidden + units, inside).to(tl.float32)
    tl.store(out_ptr + row * hidden + units, gated(gate, up, out_ptr.dtype.element_ty, GELU), inside)


def gated_activation(gate_up: torch.Tensor, activation: str, wrap: Wrap = unwrapped) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up`` [..., 2 * hidden] (gate first, then up); returns [..., hidden] in its
    dtype. ``activation``: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU)."""
    assert activation in ACTIVATIONS and gate_up.shape[-1] % 2 == 0
    gate_up = gate_up.contiguous()  # the kernel indexes rows of 2 * hidden elements
    hidden = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], hidden), dtype=gate_up.dtype, device=gate_up.device)
    rows = gate_up.numel() // gate_up.shape[-1]
    wrap(_gated_activation)[(rows, triton.cdiv(hidden, BLOCK))](
        gate_up, out, hidden, GELU=activation == "gelu_tanh", BLOCK=BLOCK
    )
    return out
