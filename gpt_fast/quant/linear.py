"""Quantized linear layers, and the swap that puts them in a model.

The model is built as usual (on the meta device) and :func:`quantize_linears` replaces the linear layers that a
checkpoint's ``config.json`` says are quantized, before the weights are loaded; the model's code is unchanged.
Quantized tensors are parameters that need no gradient, so the model's parameters are still exactly the bytes a
decode step reads (``gpt_fast.model.weight_bytes_per_token``). Once the model is on its device,
:func:`prepare_quantized` picks each layer's kernel (:mod:`gpt_fast.quant.kernels`) and repacks the weights where
a kernel wants its own layout.
"""

from __future__ import annotations

import torch
from torch import nn

from gpt_fast.config import ModelConfig, QuantConfig
from gpt_fast.quant.kernels import FEW_ROWS, int4_cpu_linear, int4_linear, int8_linear, resolve_kernel
from gpt_fast.quant.layout import quantized_linears, quantized_tensors
from gpt_fast.quant.schemes import INT4_MID, unpack_int4

CPU_INT4_ROWS = 16  # torch's CPU int4 kernel takes matrices of a multiple of 16 rows


def _frozen(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantizedLinear(nn.Module):
    """The tensors of one quantized [out, in] weight (:func:`gpt_fast.quant.layout.quantized_tensors`), and the
    float ``bias`` [out] of the layer it replaces, if that had one (q/k/v biases), which stays as it was."""

    def __init__(self, in_features: int, out_features: int, quant: QuantConfig, bias: bool) -> None:
        super().__init__()
        for name, (shape, dtype) in quantized_tensors(out_features, in_features, quant, torch.float32).items():
            setattr(self, name, _frozen(shape, dtype))
        self.bias = _frozen((out_features,), torch.float32) if bias else None
        self.kernel = "dequant"

    def biased(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias


class Int8Linear(QuantizedLinear):
    """``y = x @ (weight * scales[:, None]).T``: int8 weights [out, in], one scale per output channel."""

    def prepare(self, kernel: str) -> None:
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.biased(int8_linear(x, self.weight, self.scales, self.kernel))


class Int4Linear(QuantizedLinear):
    """int4 weights [out, in / 2] (two per byte), a scale and a zero point per group of ``group_size`` inputs."""

    def __init__(self, in_features: int, out_features: int, quant: QuantConfig, bias: bool) -> None:
        super().__init__(in_features, out_features, quant, bias)
        self.group_size = quant.group_size

    def prepare(self, kernel: str) -> None:
        """``aten`` on the CPU keeps a copy of the weights repacked for
        ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (scales and zeros as one [groups, out, 2] tensor), for few
        rows; elsewhere, and for a shape that kernel does not take, ``aten`` means ``dequant``."""
        if kernel != "aten" or self.weight.device.type != "cpu" or self.weight.shape[0] % CPU_INT4_ROWS:
            self.kernel = "dequant" if kernel == "aten" else kernel
            return
        levels = unpack_int4(self.weight).to(torch.int32)  # [N, K]
        padded = self.scales.shape[1] * self.group_size
        levels = nn.functional.pad(levels, (0, padded - levels.shape[1]), value=INT4_MID)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
        self.register_buffer("cpu_packed", packed, persistent=False)
        scales_and_zeros = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("cpu_scales_and_zeros", scales_and_zeros, persistent=False)
        self.kernel = "aten"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "aten" and x.numel() // x.shape[-1] <= FEW_ROWS:
            return self.biased(int4_cpu_linear(x, self.cpu_packed, self.cpu_scales_and_zeros, self.group_size))
        return self.biased(int4_linear(x, self.weight, self.scales, self.zeros, self.group_size, self.kernel))


LINEARS = {"int8": Int8Linear, "int4": Int4Linear}


def quantize_linears(model: nn.Module, config: ModelConfig, quant: QuantConfig) -> None:
    """Replace the linear layers ``quant`` quantizes by empty quantized ones (build ``model`` on the meta device,
    call this, then load the quantized state)."""
    for prefix, (out_features, in_features) in quantized_linears(config, quant).items():
        parent, _, attr = prefix.rpartition(".")
        module = model.get_submodule(parent)
        bias = getattr(getattr(module, attr, None), "bias", None) is not None
        setattr(module, attr, LINEARS[quant.mode](in_features, out_features, quant, bias))


def prepare_quantized(model: nn.Module, device: torch.device, kernel: str = "auto") -> None:
    """Choose the kernels of every quantized layer for ``device`` (``auto``: see
    :func:`gpt_fast.quant.kernels.resolve_kernel`), once the weights are there."""
    resolved = resolve_kernel(kernel, device)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.prepare(resolved)
