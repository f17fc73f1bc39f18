"""Quantized linear layers, and the swap that puts them in a model.

The model is built as usual (on the meta device) and :func:`quantize_linears` replaces the linear layers that a
checkpoint's ``config.json`` says are quantized, before the weights are loaded; the model's code is unchanged.
Quantized tensors are parameters that need no gradient, so the model's parameters are still exactly the bytes a
decode step reads (``gpt_fast.model.transformer.weight_bytes_per_token``). Once the model is on its device,
:func:`prepare_quantized` picks each layer's kernel (:mod:`gpt_fast.quant.products`) and repacks the weights where
a kernel wants its own layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gpt_fast.kernels import cpu_gemv
from gpt_fast.kernels.gemlite_int8 import GemliteWeights, gemlite_int8_product, gemlite_int8_weights
from gpt_fast.model.config import EmbeddingQuant, ModelConfig, QuantConfig
from gpt_fast.quant.layout import TABLE, quantized_linears, quantized_tensors
from gpt_fast.quant.products import (
    CPP_KERNELS,
    FEW_ROWS,
    GEMLITE_ROWS,
    INT4_GEMV_ROWS,
    INT4_ROWS_MATMUL,
    INT8_BLOCK,
    SIXTEEN_BITS,
    cpp_takes,
    group_columns,
    group_interleave,
    int4_aten_linear,
    int4_cpp_linear,
    int4_linear,
    int4_triton_linear,
    int4_words_linear,
    int8_dequantize,
    int8_interleave,
    int8_linear,
    load_kernel,
    q8_takes,
    resolve_kernel,
    takes_matmul,
)
from gpt_fast.quant.schemes import INT4_MID, unpack_int4

CPU_INT4_ROWS = 16  # torch's CPU int4 kernel takes matrices of a multiple of 16 rows
TINYGEMM_K_TILES = (8, 4, 2)  # inner k tiles of the CUDA int4 layout, the largest that divides the columns


def _frozen(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantizedLinear(nn.Module):
    """The tensors of one quantized [out, in] weight (:func:`gpt_fast.quant.layout.quantized_tensors`), and the
    float ``bias`` [out] of the layer it replaces, if that had one (q/k/v biases), which stays as it was."""

    def __init__(self, in_features: int, out_features: int, quant: QuantConfig | EmbeddingQuant, bias: bool) -> None:
        super().__init__()
        for name, (shape, dtype) in quantized_tensors(out_features, in_features, quant, torch.float32).items():
            setattr(self, name, _frozen(shape, dtype))
        self.bias = _frozen((out_features,), torch.float32) if bias else None
        self.in_features = in_features
        self.kernel = "dequant"
        self.pdl = False  # compiled steps launch the triton kernel with PDL (launch_with_pdl)

    def prepare(self, kernel: str) -> None:
        """Compute with ``kernel`` as :func:`gpt_fast.quant.products.resolve_kernel` resolved it."""
        self.kernel = kernel

    def biased(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def fuses_row(self) -> bool:
        """Whether :meth:`row` computes this layer's products of a decode step's row."""
        return False

    def row(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        activation: str | None = None,
    ) -> torch.Tensor:
        """The product of one row ``x`` [1, K] of a compiled decode step (where :meth:`fuses_row`) in one kernel
        with its neighbours, so that none is a kernel of its own: the RMSNorm of ``x`` before it (``norm_weight``
        [K], ``eps``), and after it ``residual`` [1, N] added or, for a gated MLP's ``w13`` (``activation``), the
        activation of its gate rows times its up rows: [1, N] or [1, N / 2], each rounded as the model rounds. A
        bias is added after the kernel: the layers that have one (Qwen2's q, k and v) take a norm only."""
        assert self.fuses_row() and (self.bias is None or (residual is None and activation is None))
        operator, weights = self._row_kernel()
        return self.biased(operator(x, *weights, residual, norm_weight, eps, activation))

    def _row_kernel(self) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor | int, ...]]:
        """The operator of :meth:`row` and this layer's weights it takes before the row's neighbours."""
        raise NotImplementedError

    def launch_pdl(self) -> bool:
        """Whether this call's ``triton`` kernel is launched with PDL: asked for, and in a compiled step (eager
        steps and prefills are not captured in CUDA graphs, where launching from Python would cost time)."""
        return self.pdl and torch.compiler.is_compiling()


class Int8Linear(QuantizedLinear):
    """``y = x @ (weight * scales[:, None]).T``: int8 weights [out, in], one scale per output channel; or, with a
    ``group_size`` (a tied embedding table's scheme, :class:`gpt_fast.model.config.EmbeddingQuant`), ``scales``
    [out, groups], one per group of that many inputs."""

    def __init__(self, in_features: int, out_features: int, quant: QuantConfig | EmbeddingQuant, bias: bool) -> None:
        super().__init__(in_features, out_features, quant, bias)
        self.group_size = quant.group_size
        self.batched: GemliteWeights | None = None  # gemlite's copy, for products of GEMLITE_ROWS rows

    def prepare(self, kernel: str) -> None:
        """``triton``, for a 16-bit model (its scales' dtype) whose inputs are a multiple of 64: the weights
        repacked for our float16-pairs kernel (:func:`gpt_fast.quant.products.int8_interleave`) into ``words``,
        which replaces ``weight`` (prefills read it too): one copy of the weights in memory. Otherwise
        ``weight`` stays, read as it is; ``cpp`` where our C++ kernel does not take the layer
        (:func:`gpt_fast.quant.products.cpp_takes`) means ``dequant``. Scales per group take ``cpp`` (groups of
        a multiple of 16 that divide the inputs) or ``dequant``. ``cpp-q8`` where its kernel does not take the
        layer (:func:`gpt_fast.quant.products.q8_takes`: outputs a multiple of 16 too) means ``cpp``; where it takes
        it, the weights and scales are packed for its kernel (:func:`gpt_fast.kernels.cpu_gemv.pack_int8_q8`) into
        ``words`` and ``scales`` [N / 16, groups, 16], which replace them. ``gemlite`` is ``triton`` with gemlite's
        copy of the weights beside the words, in a 16-bit model, for products of
        :data:`gpt_fast.quant.products.GEMLITE_ROWS` rows."""
        takes = cpp_takes(self.weight, self.scales, self.in_features, "int8", self.group_size)
        if kernel == "cpp-q8" and takes and q8_takes(self.weight.shape[0], self.in_features, self.group_size):
            self.kernel = kernel
            packed = cpu_gemv.pack_int8_q8(self.weight, self.scales)
            self.words, self.scales = (nn.Parameter(t, requires_grad=False) for t in packed)
            self.weight = None
            return
        kernel = "cpp" if kernel == "cpp-q8" else kernel
        if self.group_size is not None:
            self.kernel = "cpp" if kernel == "cpp" and takes else "dequant"
            return
        batched, kernel = kernel == "gemlite", "triton" if kernel == "gemlite" else kernel
        self.kernel = "dequant" if kernel == "cpp" and not takes else kernel
        sixteen_bits = self.scales.dtype in SIXTEEN_BITS
        if kernel == "triton" and sixteen_bits and self.weight.shape[1] % INT8_BLOCK == 0:
            if batched:
                self.batched = gemlite_int8_weights(self.weight, self.scales)
            self.words = nn.Parameter(int8_interleave(self.weight), requires_grad=False)
            self.weight = None

    def fuses_row(self) -> bool:
        """The ``triton`` kernel on the repacked words (16-bit models): see :meth:`QuantizedLinear.row`."""
        return self.kernel == "triton" and self.weight is None

    def _row_kernel(self) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor | int, ...]]:
        return torch.ops.gpt_fast.int8_row, (self.words, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batched is not None and x.numel() // x.shape[-1] in GEMLITE_ROWS:
            out = gemlite_int8_product(x.reshape(-1, x.shape[-1]), self.batched)  # [M, N]
            return self.biased(out.reshape(*x.shape[:-1], out.shape[-1]))
        weight = self.words if self.weight is None else self.weight
        return self.biased(int8_linear(x, weight, self.scales, self.kernel, self.launch_pdl(), self.group_size))


class Int8Embedding(Int8Linear):
    """A tied embedding table quantized in place (``quantization.embeddings``): int8 ``weight`` [vocab, dim] and
    ``scales`` ([vocab], or [vocab, groups]). Called with token ids it looks up their rows, dequantized (a row per
    token); :meth:`project` is the output projection, the product with the same tensors (one copy in memory)."""

    def __init__(self, vocab_size: int, dim: int, quant: EmbeddingQuant) -> None:
        super().__init__(dim, vocab_size, quant, bias=False)

    def prepare(self, kernel: str) -> None:
        """As :meth:`Int8Linear.prepare`, but ``triton``, whose words would replace ``weight``, means ``dequant``,
        and so does ``gemlite``; ``cpp-q8``'s packed words replace it, and the lookup reads them."""
        super().prepare("dequant" if kernel in ("triton", "gemlite") else kernel)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The rows of tokens ``idx`` [...]: [..., dim] in the scales' dtype."""
        if self.weight is None:  # cpp-q8's packed words
            weight, scales = cpu_gemv.unpack_int8_q8(self.words, self.scales, idx)
            return int8_dequantize(weight, scales if self.group_size else scales[..., 0], self.group_size)
        return int8_dequantize(self.weight[idx], self.scales[idx], self.group_size)  # rows [..., dim] int8

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The output projection: ``x`` [..., dim] -> logits [..., vocab]."""
        return super().forward(x)


class Int4Linear(QuantizedLinear):
    """int4 weights [out, in / 2] (two per byte), a scale and a zero point per group of ``group_size`` inputs."""

    def __init__(self, in_features: int, out_features: int, quant: QuantConfig, bias: bool) -> None:
        super().__init__(in_features, out_features, quant, bias)
        self.group_size = quant.group_size

    def prepare(self, kernel: str) -> None:
        """``aten`` repacks a copy of the weights for PyTorch's own int4 kernel of the device, used for few rows:
        on the CPU ``_weight_int4pack_mm_for_cpu``; on CUDA (bf16 only) tinygemm, ``_weight_int4pack_mm``; where
        that kernel does not take the shape or dtype, ``aten`` means ``dequant``. ``triton`` repacks the weights for
        our Triton kernel (:func:`gpt_fast.quant.products.group_interleave`) into ``words``, which replaces
        ``weight`` (prefills read it too): one copy of the weights in memory. ``cpp`` reads the weights as they are;
        where our C++ kernel does not take the layer (:func:`gpt_fast.quant.products.cpp_takes`, groups of a
        multiple of 32) it means ``dequant``. ``cpp-q8`` packs the weights for its kernel
        (:func:`gpt_fast.kernels.cpu_gemv.pack_int4_q8`) into ``words``, ``scales`` and ``zeros`` [N / 16, groups,
        16], which replace ``weight``, ``scales`` and ``zeros``; where that kernel does not take the layer (groups a
        power of two, outputs a multiple of 16) it means ``cpp``. ``gemlite`` means ``triton`` (see
        :mod:`gpt_fast.quant.products`)."""
        kernel = "triton" if kernel == "gemlite" else kernel
        repack = {"cpu": self._repack_cpu, "cuda": self._repack_cuda}.get(self.weight.device.type)
        if kernel == "aten" and repack is not None and repack():
            self.kernel = "aten"
        elif kernel in CPP_KERNELS:
            takes = cpp_takes(self.weight, self.scales, self.in_features, "int4", self.group_size)
            packs = q8_takes(self.weight.shape[0], self.in_features, self.group_size)
            self.kernel = ("cpp-q8" if kernel == "cpp-q8" and packs else "cpp") if takes else "dequant"
        else:
            self.kernel = "dequant" if kernel == "aten" else kernel
        if self.kernel == "triton":
            self.words = nn.Parameter(group_interleave(self.weight, self.group_size), requires_grad=False)
            self.weight = None
        if self.kernel == "cpp-q8":
            packed = cpu_gemv.pack_int4_q8(self.weight, self.scales, self.zeros)
            self.words, self.scales, self.zeros = (nn.Parameter(t, requires_grad=False) for t in packed)
            self.weight = None

    def _repack_cpu(self) -> bool:
        """Scales and zeros as one [groups, out, 2] tensor; columns padded to whole groups."""
        if self.weight.shape[0] % CPU_INT4_ROWS:
            return False
        levels = unpack_int4(self.weight).to(torch.int32)  # [N, K]
        padded = self.scales.shape[1] * self.group_size
        levels = nn.functional.pad(levels, (0, padded - levels.shape[1]), value=INT4_MID)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1), persistent=False)
        self._stack_scales_and_zeros()
        return True

    def _repack_cuda(self) -> bool:
        """tinygemm's tiles: bf16, whole groups, rows a multiple of 8, columns of ``TINYGEMM_K_TILES`` x 16; its
        bytes hold column 2j in the high nibble (ours: the low one)."""
        out_features, cols = self.weight.shape[0], self.weight.shape[1] * 2
        tiles = next((t for t in TINYGEMM_K_TILES if cols % (16 * t) == 0), None)
        if self.scales.dtype != torch.bfloat16 or out_features % 8 or cols % self.group_size or tiles is None:
            return False
        swapped = (self.weight << 4) | (self.weight >> 4)  # [N, K/2] uint8
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(swapped, tiles), persistent=False)
        self._stack_scales_and_zeros()
        return True

    def _stack_scales_and_zeros(self) -> None:
        stacked = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous()  # [groups, N, 2]
        self.register_buffer("scales_and_zeros", stacked, persistent=False)

    def fuses_row(self) -> bool:
        """The ``triton`` kernel summing in float16 pairs (16-bit models, columns a multiple of 4): see
        :meth:`QuantizedLinear.row`."""
        return self.kernel == "triton" and self.scales.dtype in SIXTEEN_BITS and self.in_features % 4 == 0

    def _row_kernel(self) -> tuple[Callable[..., torch.Tensor], tuple[torch.Tensor | int, ...]]:
        return torch.ops.gpt_fast.int4_row, (self.words, self.scales, self.zeros, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        few = rows.shape[0] <= FEW_ROWS
        if self.kernel == "triton" and takes_matmul(rows, INT4_GEMV_ROWS):
            group, tensors = self.group_size, (self.words, self.scales, self.zeros)
            if rows.shape[0] <= INT4_ROWS_MATMUL:
                out = torch.ops.gpt_fast.int4_rows(rows, *tensors, group)
            else:
                out = torch.ops.gpt_fast.int4_matmul(group_columns(rows, group), *tensors, group)
        elif self.kernel == "cpp-q8":
            out = cpu_gemv.int4_q8_gemv(rows, self.words, self.scales, self.zeros, self.group_size)
        elif self.kernel == "cpp":
            out = int4_cpp_linear(rows, self.weight, self.scales, self.zeros, self.group_size)
        elif self.kernel == "aten" and few:
            out = int4_aten_linear(rows, self.packed, self.scales_and_zeros, self.group_size)
        elif self.kernel == "triton" and few:
            out = int4_triton_linear(rows, self.words, self.scales, self.zeros, self.group_size, self.launch_pdl())
        elif self.kernel == "triton":
            out = int4_words_linear(rows, self.words, self.scales, self.zeros, self.group_size)
        else:
            out = int4_linear(rows, self.weight, self.scales, self.zeros, self.group_size)
        return self.biased(out.reshape(*x.shape[:-1], out.shape[-1]))


LINEARS = {"int8": Int8Linear, "int4": Int4Linear}


def quantize_linears(model: nn.Module, config: ModelConfig, quant: QuantConfig) -> None:
    """Replace the linear layers ``quant`` quantizes by empty quantized ones, and with ``quant.embeddings`` the
    embedding table by an :class:`Int8Embedding` (build ``model`` on the meta device, call this, then load the
    quantized state)."""
    for prefix, (out_features, in_features) in quantized_linears(config, quant).items():
        parent, _, attr = prefix.rpartition(".")
        module = model.get_submodule(parent)
        bias = getattr(getattr(module, attr, None), "bias", None) is not None
        setattr(module, attr, LINEARS[quant.mode](in_features, out_features, quant, bias))
    if quant.embeddings is not None:
        setattr(model, TABLE, Int8Embedding(config.vocab_size, config.dim, quant.embeddings))


def prepare_quantized(model: nn.Module, device: torch.device, kernel: str = "auto") -> None:
    """Choose the kernels of every quantized layer for ``device`` (``auto``: see
    :func:`gpt_fast.quant.products.resolve_kernel` and each layer's ``prepare``), once the weights are there."""
    resolved = resolve_kernel(kernel, device)
    load_kernel(resolved)
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.prepare(resolved)


def launch_with_pdl(root: nn.Module, pdl: bool) -> None:
    """Whether the quantized layers inside ``root`` that compute with our Triton kernel launch it with PDL in
    compiled steps (:func:`gpt_fast.quant.products.register_triton_ops`): the engine asks for it in a model's
    decoder layers where its unquantized GEMVs are ours (``linear_kernel`` ``triton``: CUDA-graph steps on a GPU
    that launches with PDL), measured faster there (docs/bench/HISTORY.md, 2026-11-24e)."""
    for module in root.modules():
        if isinstance(module, QuantizedLinear):
            module.pdl = pdl and module.kernel == "triton"
