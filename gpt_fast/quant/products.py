"""The products of activations with quantized weights, one function per scheme, each with the kernels it can use.

A decode step multiplies a few rows of activations (up to :data:`FEW_ROWS`) by each weight matrix, and its time
is the time to read the weights: that is what the specialized kernels are for. More rows (a prompt, a perplexity
window, a batch) are a matrix product: on a CUDA GPU with our kernels' words, our Triton product
(:mod:`gpt_fast.kernels.triton_matmul`, see :func:`takes_matmul`), elsewhere ``dequant`` whatever the kernel:
PyTorch's own weight-only kernels are 25 to 50 times slower than dequantize-then-``F.linear`` on the CPU
for 1024 rows.

- ``triton``: our Triton kernels (:mod:`gpt_fast.kernels.triton_gemv`), on CUDA GPUs. Wrapped as
  ``torch.library.triton_op`` so that ``torch.compile`` places them in its own generated code (and CUDA graphs capture
  them). The choice on CUDA, compiled or not. int8: in a compiled 7B step it is faster than inductor's own dequantizing
  GEMV (which folds the RMSNorm into its prologue), and the same in every build, where inductor's varies with its
  coordinate-descent tuning (docs/bench/HISTORY.md, 2026-11-23j); in 16-bit models its weights are repacked
  (:func:`int8_interleave`) and summed in float16 pairs, 3 % faster again (docs/bench/HISTORY.md, 2026-11-24g). int4:
  with 16-bit activations its products are summed in float16 pairs, which makes it faster than tinygemm on the wide
  Llama-2-7B matrices and the 7B step 3 % faster, 9 % with PDL (docs/bench/HISTORY.md, 2026-11-24e). In the decode steps
  where our bf16 GEMVs run a layer's norms and residual adds inside (``FusedRow``), both kernels do too, and the gated
  activation (``int8_row``, ``int4_row``): on an H200, 7B step int8 384.8 tok/s against 373.9 with them apart, int4
  427.5 against 417.0 (docs/bench/HISTORY.md, 2026-11-25c).
- ``gemlite``: ``triton``, but an int8 layer's products of :data:`GEMLITE_ROWS` rows (a batched decode step) go
  to gemlite's kernels (:mod:`gpt_fast.kernels.gemlite_int8`, the optional ``gemlite`` package), on a second copy
  of the weights: on an H200 they take 4 to 64 rows in 0.50 to 0.87 times our matrix product's time, and the 7B's
  8-row step 4.65 ms where ours takes 6.86 (docs/bench/HISTORY.md, 2026-11-29, "Quantized products beside gemlite"). An
  int4 layer computes as with ``triton``: gemlite's int4 keeps ``(q - z) * s`` with ``z`` in 16 bits, which cannot
  hold our zero points exactly (its products' error was 2.5 times ours), and tinygemm is the fastest at 8 rows.
  Not ``auto``'s choice yet: it doubles an int8 model's weights in memory.
- ``cpp``: our C++ kernels for an x86 CPU with AVX2 (:mod:`gpt_fast.kernels.cpu_gemv`), float32 activations, on
  the weights as the checkpoint holds them (int8 with a scale per row or per group, int4): a decode step's few rows
  (up to :data:`CPP_INT8_GEMV_ROWS`, int4 :data:`CPP_INT4_GEMV_ROWS`) and a prompt's (up to
  :data:`CPP_MATMUL_ROWS`) each in kernels of their own, more in torch's matrix product of the weights dequantized.
  The CPU's choice where they build: PyTorch's own kernels were 10 to 19 times slower on the CPUs measured
  (docs/cpu.md, "Quantized products").
- ``cpp-q8``: ``cpp`` with the activations rounded to int8 per block of 32 columns, as llama.cpp rounds them for
  its Q8_0 and Q4_1 weights, so that a block's products are summed by integer instructions (AVX512-VNNI's
  vpdpbusd where the CPU has it, else AVX2's vpmaddubsw): :func:`gpt_fast.kernels.cpu_gemv.int8_q8_gemv` and
  ``int4_q8_gemv``, for any number of rows, on the layer's weights packed at load for them (``pack_int8_q8``,
  ``pack_int4_q8``; the packed copy replaces them), in blocks of 16 rows: on a Zen 4 core, one thread, a decode
  step's int4 products took 5.4 ms against 8.2 on the checkpoint's layout, and 4 rows 7.3 against 16.2
  (docs/bench/HISTORY.md, 2026-11-30k); on a Zen 3 (AVX2), 10.2 against ``cpp``'s 12.8, 4 rows 16.3 against 23.5
  (docs/bench/HISTORY.md, 2026-12-01f). Its products differ from the dequantized reference by the activations' rounding
  (relative error about 5e-3 on random rows), where ``cpp``'s differ by the order of float32 sums only. Not
  ``auto``'s choice: its greedy tokens are not the float model's (docs/cpu.md).
- ``aten``: PyTorch's own weight-only kernels, ``torch.ops.aten._weight_int8pack_mm``, and for int4
  ``_weight_int4pack_mm_for_cpu`` or CUDA's tinygemm ``_weight_int4pack_mm`` (on a copy of the weights repacked
  once at load, :mod:`gpt_fast.quant.layers`). The CPU's choice where ``cpp`` is not usable (another CPU, no C++
  compiler): they read the weights as they are, where ``dequant`` makes a float copy of them per call.
- ``dequant``: plain PyTorch, dequantize then ``F.linear``: runs everywhere (ROCm included, where our kernels are
  not used) and in every compile mode; inductor fuses it into a dequantizing matrix-vector kernel for one row.
  For int8 it is upstream gpt-fast's ``WeightOnlyInt8Linear`` formula, ``F.linear(x, w.to(x.dtype)) * scales``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from gpt_fast.kernels import cpu_gemv
from gpt_fast.kernels.available import triton_usable
from gpt_fast.kernels.gemlite_int8 import gemlite_importable
from gpt_fast.model.config import QUANT_KERNELS as KERNELS
from gpt_fast.quant.schemes import INT4_MID, int8_column_scales, pack_int4, unpack_int4

CPP_KERNELS = ("cpp", "cpp-q8")  # the kernels of our C++ library (gpt_fast.kernels.cpu_gemv)
SIXTEEN_BITS = (torch.float16, torch.bfloat16)  # what our float16-pairs kernels and the tensor cores multiply
FEW_ROWS = 16  # activation rows the specialized kernels take; more are a matrix product
# The rows of a product that each of our C++ CPU kernels takes, from a step's 120 products of the SmolLM2 shapes on a
# Zen 4 core, the weights read from memory (docs/bench/2026-11-30e_cpu_prompt_products.txt, one and two threads). A
# decode step's few rows go to the kernels that read the weights once for all of them and widen each weight once for
# every 4 rows, while they are faster: int8 up to 12 rows (41.6 ms against the tile kernel's 46.3; 16 rows 69.8
# against 56.5), int4 up to 5 (6 rows 27.8 against 24.9), ``cpp-q8``'s int8 up to 16 (38.5) and int4 up to 12 (38.7
# against 37.7; 16 rows 55.0 against 47.7). More rows go to the tile kernels, which dequantize a few weight rows at a
# time into the core's cache and multiply them by every row: a 37-row prompt's int4 products take 93.5 ms and int8's
# 104.1 against 145.5 and 125.8 for the weights dequantized whole and multiplied by torch's matrix product (two
# threads 59.5 and 67.1 against 81.8 and 85.3). Past 64 rows torch's matrix product takes them: it blocks its
# operands for the cache better than the tile kernels as the rows grow, and on an Intel Xeon with two 512-bit
# multiply-add units a core it was as fast at 64 rows and twice as fast at 256 (int4, one thread: 465.0 ms against
# 862.8), where on the Zen 4 the tile kernels still led at 256 (docs/bench/2026-11-30f_cpu_tile_kernels.txt).
CPP_INT8_GEMV_ROWS = 12
CPP_INT4_GEMV_ROWS = 5
CPP_MATMUL_ROWS = 64


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``auto``: Triton on a CUDA GPU, on the CPU our C++ kernels where they are usable, else PyTorch's own,
    plain PyTorch elsewhere. Choosing Triton registers its operators (:func:`register_triton_ops`); our C++
    library is built where the weights are read (:func:`load_kernel`), after every check that needs none."""
    if kernel not in KERNELS:
        raise ValueError(f"quantized kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel == "triton" and not triton_usable(device):
        raise ValueError(f"the triton quantized kernels need a CUDA GPU with Triton installed, not {device}")
    if kernel == "gemlite" and not (triton_usable(device) and gemlite_importable()):
        here = f"{device}, gemlite {'installed' if gemlite_importable() else 'not installed'}"
        raise ValueError(
            f"the gemlite quantized kernel needs a CUDA GPU with Triton and the gemlite package "
            f"(pip install 'gpt-fast[gemlite]'); here: {here}"
        )
    if kernel in CPP_KERNELS and not cpp_usable(device):
        raise ValueError(
            f"the {kernel} quantized kernels need an x86 CPU with AVX2, a C++ compiler and ninja, not {device}"
        )
    if kernel == "auto":
        kernel = "triton" if triton_usable(device) else "cpp" if cpp_usable(device) else _plain(device)
    if kernel in ("triton", "gemlite"):
        register_triton_ops()
    return kernel


def load_kernel(kernel: str) -> None:
    """Build and load what the chosen ``kernel`` (a name :func:`resolve_kernel` returned) needs before its layers
    are prepared: our C++ library for ours on the CPU (:func:`register_cpu_ops`; some 20 s the first time on a
    machine)."""
    if kernel in CPP_KERNELS:
        register_cpu_ops()


def _plain(device: torch.device) -> str:
    return "aten" if device.type == "cpu" else "dequant"


def cpp_usable(device: torch.device) -> bool:
    """Whether our C++ kernels run on ``device``: the CPU of a machine that can build them."""
    return device.type == "cpu" and cpu_gemv.cpu_kernels_usable()


@functools.cache
def register_cpu_ops() -> None:
    """Build and load our C++ kernels (:mod:`gpt_fast.kernels.cpu_gemv`, which registers the products
    ``torch.ops.gpt_fast.int8_gemv_cpu``, ``int8_group_gemv_cpu``, ``int4_gemv_cpu``, ``int8_q8_gemv_cpu``,
    ``int4_q8_gemv_cpu``, ``int8_matmul_cpu`` and ``int4_matmul_cpu``, and ``int4_dequantize_cpu``) and give
    ``torch.compile`` their output shapes, eagerly (see :func:`register_triton_ops`). Nothing happens at import."""
    cpu_gemv.load_cpu_kernels()

    def product(x: torch.Tensor, weight: torch.Tensor, *operands: torch.Tensor | int) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))  # [M, N] for x [M, K] and weight [N, ...]

    products = ("int8_gemv_cpu", "int8_group_gemv_cpu", "int4_gemv_cpu")
    for name in (*products, "int8_matmul_cpu", "int4_matmul_cpu"):
        torch.library.register_fake(f"gpt_fast::{name}", product)

    def packed(x: torch.Tensor, words: torch.Tensor, *operands: torch.Tensor | int) -> torch.Tensor:
        return x.new_empty((x.shape[0], words.shape[0] * cpu_gemv.Q8_ROWS))  # words [N / 16, ...]

    for name in ("int8_q8_gemv_cpu", "int4_q8_gemv_cpu"):
        torch.library.register_fake(f"gpt_fast::{name}", packed)

    @torch.library.register_fake("gpt_fast::int4_dequantize_cpu")
    def _(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
        return scales.new_empty((weight.shape[0], 2 * weight.shape[1]))


def q8_takes(rows: int, columns: int, group_size: int | None) -> bool:
    """Whether the ``cpp-q8`` kernels take a layer (one :func:`cpp_takes` takes) of ``rows`` outputs and ``columns``
    inputs with a scale per row (``group_size`` None) or per group: whole packed blocks of weight rows
    (:func:`gpt_fast.kernels.cpu_gemv.pack_int8_q8`), whole blocks of activations, groups a power of two from a block
    dividing the inputs."""
    block = cpu_gemv.Q8_BLOCK
    grouped = group_size is None or (group_size >= block and group_size & (group_size - 1) == 0)
    whole = rows % cpu_gemv.Q8_ROWS == 0 and columns % block == 0
    return whole and grouped and columns % (group_size or block) == 0


def cpp_shape_takes(mode: str, columns: int, group_size: int | None) -> bool:
    """Whether our C++ kernels (:mod:`gpt_fast.kernels.cpu_gemv`) take a layer of ``columns`` inputs quantized as
    ``mode`` with ``group_size``: inputs a multiple of the kernel's; int4 groups a multiple of its groups; int8
    scales per row, or per group of a multiple of its groups dividing the inputs."""
    if mode == "int4":
        return columns % cpu_gemv.INT4_COLUMNS == 0 and group_size % cpu_gemv.INT4_GROUPS == 0
    whole = group_size is None or (group_size % cpu_gemv.INT8_GROUPS == 0 and columns % group_size == 0)
    return columns % cpu_gemv.INT8_COLUMNS == 0 and whole


def cpp_takes(weight: torch.Tensor, scales: torch.Tensor, columns: int, mode: str, group_size: int | None) -> bool:
    """Whether our C++ kernels take a layer's ``weight`` and ``scales`` of ``columns`` inputs: on the CPU, float32
    scales (those of a float32 model, whose activations are float32), shapes they take (:func:`cpp_shape_takes`)."""
    on_cpu = weight.device.type == "cpu" and scales.dtype == torch.float32
    return on_cpu and cpp_shape_takes(mode, columns, group_size)


@functools.cache
def register_triton_ops() -> None:
    """Register the Triton kernels as the operators ``torch.ops.gpt_fast.int8_gemv`` and ``int4_gemv`` (and the
    matrix products ``int8_matmul`` and ``int4_matmul``), and as
    ``int8_gemv_pdl`` and ``int4_gemv_pdl``, launched with programmatic dependent launch
    (:mod:`gpt_fast.kernels.pdl`).

    The first four are ``triton_op``: inductor places their kernels in its own generated code, and launches them
    without PDL. The ``_pdl`` ones are opaque ``custom_op`` that launch their kernels themselves, for the decode
    steps captured in CUDA graphs (:func:`gpt_fast.quant.layers.launch_with_pdl` asks for them), where
    launching from Python costs nothing per step. So are ``int8_row`` and ``int4_row``, the products of a decode
    step's row with the norm before them, the residual add or the gated activation after them inside
    (:meth:`gpt_fast.quant.layers.QuantizedLinear.row`).

    Called when a layer is given the ``triton`` kernel, eagerly, before any compilation: ``torch.compile`` cannot
    trace a registration (it graph-breaks on it, and a CUDA-graph mode then fails), so the forward pass only
    calls the registered operators. Nothing happens at import."""
    from torch.library import custom_op, triton_op, wrap_triton

    from gpt_fast.kernels import triton_gemv, triton_matmul

    @triton_op("gpt_fast::int8_gemv", mutates_args=())
    def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return triton_gemv.int8_gemv(x, weight, scales, wrap=wrap_triton)

    @triton_op("gpt_fast::int4_gemv", mutates_args=())
    def int4_gemv(
        x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return triton_gemv.int4_gemv(x, words, scales, zeros, group_size, wrap=wrap_triton)

    @triton_op("gpt_fast::int8_matmul", mutates_args=())
    def int8_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return triton_matmul.words_matmul(x, words, scales, None, 0, wrap=wrap_triton)

    @triton_op("gpt_fast::int4_matmul", mutates_args=())
    def int4_matmul(
        x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return triton_matmul.words_matmul(x, words, scales, zeros, group_size, wrap=wrap_triton)

    @triton_op("gpt_fast::int4_rows", mutates_args=())
    def int4_rows(
        x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return triton_matmul.int4_rows(x, words, scales, zeros, group_size, wrap=wrap_triton)

    @custom_op("gpt_fast::int8_gemv_pdl", mutates_args=())
    def int8_gemv_pdl(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return triton_gemv.int8_gemv(x, weight, scales, pdl=True)

    @int8_gemv_pdl.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @custom_op("gpt_fast::int4_gemv_pdl", mutates_args=())
    def int4_gemv_pdl(
        x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return triton_gemv.int4_gemv(x, words, scales, zeros, group_size, pdl=True)

    @int4_gemv_pdl.register_fake
    def _(
        x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], scales.shape[0]))

    @custom_op("gpt_fast::int8_row", mutates_args=())
    def int8_row(
        x: torch.Tensor,
        words: torch.Tensor,
        scales: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
        activation: str | None,
    ) -> torch.Tensor:
        inside = triton_gemv.Inside(norm_weight, eps, residual, activation)
        return triton_gemv.int8_gemv(x, words, scales, pdl=True, inside=inside)

    @int8_row.register_fake
    def _(
        x: torch.Tensor,
        words: torch.Tensor,
        scales: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
        activation: str | None,
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], triton_gemv.outputs(words.shape[0], activation)))

    @custom_op("gpt_fast::int4_row", mutates_args=())
    def int4_row(
        x: torch.Tensor,
        words: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
        activation: str | None,
    ) -> torch.Tensor:
        inside = triton_gemv.Inside(norm_weight, eps, residual, activation)
        return triton_gemv.int4_gemv(x, words, scales, zeros, group_size, pdl=True, inside=inside)

    @int4_row.register_fake
    def _(
        x: torch.Tensor,
        words: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
        activation: str | None,
    ) -> torch.Tensor:
        return x.new_empty((x.shape[0], triton_gemv.outputs(scales.shape[0], activation)))


# Rows our GEMVs take where a product of the words can (more take it: it reads each block of weights once for all
# of them), the crossovers on an H200 over a Llama-2-7B layer's products. int8, with the prompt's matrix product
# (docs/bench/HISTORY.md, 2026-11-25d): 4 rows 160 us against 172. int4, with int4_rows (BENCHMARKS.md, 2026-12-02e):
# 5 rows 140.0 us against 145.2, 6 rows 164.9 against 146.0
INT8_GEMV_ROWS = 3
GEMLITE_ROWS = range(4, 65)  # the rows of an int8 product that the ``gemlite`` kernel gives to gemlite
INT4_GEMV_ROWS = 5
# Rows up to which an int4 product past our GEMV takes the words as the tensor cores' first operand
# (:func:`gpt_fast.kernels.triton_matmul.int4_rows`); more take the prompt's tiles (``int4_matmul``)
INT4_ROWS_MATMUL = 64
# Compiled, a prefill of more rows dequantizes the words in inductor's fused kernel and multiplies in cuBLAS: the 7B
# int4 model's 1024-token prefill takes 29.8 ms so, where our product's kernels alone sum to about 82 ms; at 64 rows
# ours matches what a whole-matrix dequantization plus cuBLAS would cost (estimated from the bytes, the cut itself not
# measured; docs/bench/HISTORY.md, 2026-11-25d). Eager, ours is faster at every length measured (4 to 1024 rows)
COMPILED_MATMUL_ROWS = 64


def takes_matmul(rows: torch.Tensor, gemv_rows: int) -> bool:
    """Whether the product of ``rows`` [M, K] with weights kept as words (our kernels': those words exist only
    where they run, see :func:`resolve_kernel`) is our Triton matrix product
    (:mod:`gpt_fast.kernels.triton_matmul`): 16-bit activations (the tensor cores' inputs) on a CUDA GPU, more than
    ``gemv_rows`` of them, at most :data:`COMPILED_MATMUL_ROWS` in a compiled prefill."""
    m = rows.shape[0]
    compiled_rows = m <= COMPILED_MATMUL_ROWS or not torch.compiler.is_compiling()
    return rows.is_cuda and rows.dtype in SIXTEEN_BITS and m > gemv_rows and compiled_rows


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    kernel: str,
    pdl: bool = False,
    group_size: int | None = None,
) -> torch.Tensor:
    """``x`` [..., K] times the int8 ``weight`` [N, K] (or, for the ``triton`` kernel, its words [N, K / 4] from
    :func:`int8_interleave`; for ``cpp-q8``, the words and scales of ``pack_int8_q8``) with per-channel ``scales``
    [N] (in ``x``'s dtype); ``pdl``: the ``triton`` kernel's
    operator launched with PDL (see :func:`register_triton_ops`). With a ``group_size``, ``scales`` [N, groups]
    hold one scale per group of columns: ``cpp`` (:func:`gpt_fast.kernels.cpu_gemv.int8_group_gemv`) or
    ``dequant``."""
    rows = x.reshape(-1, x.shape[-1])
    if group_size is not None:
        out = _int8_group_linear(rows, weight, scales, kernel, group_size)  # [M, N]
        return out.reshape(*x.shape[:-1], out.shape[-1])
    few = rows.shape[0] <= FEW_ROWS
    words = weight.dtype == torch.int32
    if kernel == "triton" and words and takes_matmul(rows, INT8_GEMV_ROWS):
        out = torch.ops.gpt_fast.int8_matmul(interleave_columns(rows), weight, scales)
    elif kernel == "triton" and few:
        gemv = torch.ops.gpt_fast.int8_gemv_pdl if pdl else torch.ops.gpt_fast.int8_gemv
        out = gemv(rows.contiguous(), weight, scales)
    elif kernel == "cpp-q8":
        out = cpu_gemv.int8_q8_gemv(rows, weight, scales, None)
    elif kernel == "cpp" and rows.shape[0] <= CPP_INT8_GEMV_ROWS:
        out = cpu_gemv.int8_gemv(rows, weight, scales)
    elif kernel in CPP_KERNELS and rows.shape[0] <= CPP_MATMUL_ROWS:
        out = cpu_gemv.int8_matmul(rows, weight, scales, None)
    elif kernel == "aten" and few:
        out = torch.ops.aten._weight_int8pack_mm(rows, weight, scales)
    elif words:  # the words' bytes are the columns in interleaved order: so are the rows'
        out = F.linear(interleave_columns(rows), weight.view(torch.uint8).to(x.dtype) - 128) * scales
    else:
        out = F.linear(rows, weight.to(x.dtype)) * scales
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _int8_group_linear(
    rows: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, kernel: str, group_size: int
) -> torch.Tensor:
    """``rows`` [M, K] times the int8 ``weight`` [N, K] with ``scales`` [N, groups]: [M, N]."""
    if kernel == "cpp-q8":
        return cpu_gemv.int8_q8_gemv(rows, weight, scales, group_size)
    if kernel == "cpp" and rows.shape[0] <= CPP_INT8_GEMV_ROWS:
        return cpu_gemv.int8_group_gemv(rows, weight, scales, group_size)
    if kernel in CPP_KERNELS and rows.shape[0] <= CPP_MATMUL_ROWS:
        return cpu_gemv.int8_matmul(rows, weight, scales, group_size)
    return F.linear(rows, int8_dequantize(weight, scales, group_size).to(rows.dtype))


def int8_dequantize(weight: torch.Tensor, scales: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """The int8 ``weight`` [..., K] with ``scales`` ([...], or [..., groups] of ``group_size``) as the [..., K]
    matrix in ``scales``' dtype, in plain PyTorch for inductor to fuse."""
    return weight.to(scales.dtype) * int8_column_scales(scales, weight.shape[-1], group_size)


INT8_BLOCK = 64  # columns of a block of int8_interleave: 8 elements of two words


def interleave_columns(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., K] (K a multiple of :data:`INT8_BLOCK`) with its columns in :func:`int8_interleave`'s order: in
    each block of 64, ``4 e`` to ``4 e + 3`` then ``32 + 4 e`` to ``32 + 4 e + 3``, for e = 0 to 7."""
    halves = t.reshape(*t.shape[:-1], -1, 2, INT8_BLOCK // 8, 4)  # [..., blocks, half, element, column]
    return halves.transpose(-3, -2).reshape(t.shape)


def int8_interleave(weight: torch.Tensor) -> torch.Tensor:
    """The int8 ``weight`` [N, K] (K a multiple of :data:`INT8_BLOCK`) as the 32-bit words [N, K / 4] that
    :func:`gpt_fast.kernels.triton_gemv.int8_gemv` reads two at a time: in each block of 64 columns, words ``2 e``
    and ``2 e + 1`` hold columns ``4 e`` to ``4 e + 3`` and ``32 + 4 e`` to ``32 + 4 e + 3``, lowest byte first,
    each byte ``q + 128`` (unsigned). A prefill multiplies these bytes as they lie by its rows' columns put in
    the same order (:func:`interleave_columns`, a few megabytes where undoing the interleave reads every
    weight)."""
    offset = weight.view(torch.uint8) ^ 0x80  # [N, K]: q + 128
    return interleave_columns(offset).contiguous().view(torch.int32)


def int4_dequantize(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The [N, K] matrix in ``scales``' dtype, written in plain PyTorch for inductor to fuse."""
    return _dequantize_levels(unpack_int4(weight), scales, zeros, group_size)


def _dequantize_levels(
    levels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The levels [N, K] (uint8) with ``scales`` and ``zeros`` [N, groups] as the [N, K] matrix."""
    out_features, n_groups = scales.shape
    cols = levels.shape[1]
    pad = n_groups * group_size - cols
    if pad:  # the shorter last group, padded for the reshape below
        levels = F.pad(levels, (0, pad), value=INT4_MID)
    grouped = levels.reshape(out_features, n_groups, group_size).to(scales.dtype)
    w = (grouped - INT4_MID) * scales[..., None] + zeros[..., None]
    return w.reshape(out_features, -1)[:, :cols]


def int4_linear(
    rows: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``rows`` [M, K] times the int4 ``weight`` [N, K / 2] with ``scales`` and ``zeros`` [N, groups], dequantized
    (the ``dequant`` kernel, and every kernel's path for more than :data:`FEW_ROWS` rows)."""
    return F.linear(rows, int4_dequantize(weight, scales, zeros, group_size).to(rows.dtype))


def group_interleave(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """The int4 ``weight`` [N, K/2] (uint8, two columns per byte) as the 32-bit words [N, G * group_size / 8]
    that :func:`gpt_fast.kernels.triton_gemv.int4_gemv` reads (G whole groups; a shorter last group padded): word
    ``j`` of group ``g`` holds, in its nibble ``k`` (bits 4k to 4k+3, k < 4), column ``g * group_size + 2 (k *
    group_size / 8 + j)``, and in nibble ``k + 4`` the column after it."""
    nibbles = group_columns(unpack_int4(weight), group_size)  # [N, G * group_size]: word w's nibble i at 8 w + i
    words = pack_int4(nibbles.reshape(-1, 8))  # [N * G * words, 4]: each word's bytes, lowest first
    return words.contiguous().view(torch.int32).reshape(weight.shape[0], -1)


def group_columns(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """``t`` [R, K] padded with zeros to whole groups, its columns in the order of :func:`group_interleave`'s
    nibbles (word ``w``'s nibble ``i`` at ``8 w + i``): the levels that become the words, and the activations that
    our matrix product multiplies by them as they lie (:mod:`gpt_fast.kernels.triton_matmul`)."""
    rows, k = t.shape
    groups = -(-k // group_size)
    padded = F.pad(t, (0, groups * group_size - k))  # [R, G * group_size]
    pairs = padded.reshape(rows, groups, 4, group_size // 8, 2)  # [R, G, k, words, column of the pair]
    return pairs.permute(0, 1, 3, 4, 2).reshape(rows, -1)  # [R, G, words, 8]: nibble 4 * (column of the pair) + k


def group_deinterleave(words: torch.Tensor, group_size: int, cols: int) -> torch.Tensor:
    """The levels [N, cols] (uint8) that :func:`group_interleave` put into ``words``."""
    nibbles = unpack_int4(words.view(torch.uint8))  # [N, G * group_size]: word w's nibble i at 8 w + i
    pairs = nibbles.reshape(words.shape[0], -1, group_size // 8, 2, 4)  # [N, G, words, column of the pair, k]
    return pairs.permute(0, 1, 4, 2, 3).reshape(words.shape[0], -1)[:, :cols]


def int4_words_linear(
    rows: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``rows`` [M, K] (many) times the weight repacked for our Triton kernel, dequantized (the prefill of a layer
    that keeps only that copy, :class:`gpt_fast.quant.layers.Int4Linear`, where :func:`takes_matmul` says no)."""
    levels = group_deinterleave(words, group_size, rows.shape[-1])
    return F.linear(rows, _dequantize_levels(levels, scales, zeros, group_size).to(rows.dtype))


def int4_triton_linear(
    rows: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    pdl: bool = False,
) -> torch.Tensor:
    """``rows`` [M, K] (few) times a weight repacked for our Triton kernel (:func:`group_interleave`, see
    :class:`gpt_fast.quant.layers.Int4Linear`); ``pdl`` as for :func:`int8_linear`."""
    gemv = torch.ops.gpt_fast.int4_gemv_pdl if pdl else torch.ops.gpt_fast.int4_gemv
    return gemv(rows.contiguous(), words, scales, zeros, group_size)


def int4_cpp_linear(
    rows: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """``rows`` [M, K] (float32) times the int4 ``weight`` [N, K / 2] as the checkpoint holds it, with our C++ kernels
    (a layer takes them where :func:`cpp_takes` says so): :func:`gpt_fast.kernels.cpu_gemv.int4_gemv` up to
    :data:`CPP_INT4_GEMV_ROWS` rows, ``int4_matmul`` up to :data:`CPP_MATMUL_ROWS`, and more in ``F.linear`` with the
    weights dequantized by our C++ code."""
    m = rows.shape[0]
    if m <= CPP_INT4_GEMV_ROWS:
        return cpu_gemv.int4_gemv(rows, weight, scales, zeros, group_size)
    if m <= CPP_MATMUL_ROWS:
        return cpu_gemv.int4_matmul(rows, weight, scales, zeros, group_size)
    return F.linear(rows, cpu_gemv.int4_dequantize(weight, scales, zeros, group_size))


def int4_aten_linear(
    rows: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``rows`` [M, K] (few) times a weight repacked for PyTorch's own int4 kernel of its device (see
    :class:`gpt_fast.quant.layers.Int4Linear`): ``_weight_int4pack_mm_for_cpu`` (columns padded to a whole number
    of groups: ``rows`` are padded with zeros to match) or, on CUDA, tinygemm's ``_weight_int4pack_mm``."""
    padded = scales_and_zeros.shape[0] * group_size
    if padded != rows.shape[1]:
        rows = F.pad(rows, (0, padded - rows.shape[1]))
    if rows.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(rows.contiguous(), packed, group_size, scales_and_zeros)
