"""Where our Triton kernels run: CUDA GPUs with Triton installed. ROCm builds of torch drive HIP through
``torch.cuda`` and are left to PyTorch's own code (our kernels use NVIDIA-only launch features and are untested
there)."""

from __future__ import annotations

import importlib.util

import torch


def triton_usable(device: torch.device) -> bool:
    """Whether our Triton kernels may run on ``device``: a CUDA GPU (not a ROCm build) with Triton installed."""
    return device.type == "cuda" and torch.version.hip is None and importlib.util.find_spec("triton") is not None
