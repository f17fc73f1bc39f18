"""Our C++ kernels for the quantized products of an x86 CPU (``cpu_gemv.cpp`` beside this file; the library also
holds the decode attention of ``cpu_attention.cpp``, :mod:`gpt_fast.kernels.cpu_attention`): the operators
``torch.ops.gpt_fast.int8_gemv_cpu``, ``int8_group_gemv_cpu`` and ``int4_gemv_cpu`` for a decode step's few rows,
``int8_matmul_cpu`` and ``int4_matmul_cpu`` for a prompt's many, ``int4_dequantize_cpu`` for longer prompts' torch
matrix product; and ``int8_q8_gemv_cpu`` and ``int4_q8_gemv_cpu``, whose activations are rounded to int8 per 32
columns as llama.cpp rounds them, so that each block's sums are integer instructions (AVX512-VNNI's where the CPU has
them, else AVX2's).

They exist because PyTorch's own weight-only CPU kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)
are slower than the float32 product they replace: scalar code on an AVX2 CPU, and on an AVX-512 one (a Zen 4 EPYC) a
decode step's products took 10 to 19 times ours (docs/bench/HISTORY.md, 2026-11-30b); and inductor turns a dequantizing
product into a float copy of the weights and a matrix product (docs/cpu.md, "Quantized products"). The source is
compiled once per machine with torch's own extension builder (a C++ compiler and ninja; torch keeps the library in
its extensions folder and rebuilds it when the source changes), when a checkpoint first asks for these kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import time
from pathlib import Path

import torch

SOURCE_NAMES = ("cpu_gemv.cpp", "cpu_attention.cpp", "cpu_layers.cpp", "cpu_threads.cpp")
SOURCES = tuple(Path(__file__).with_name(name) for name in SOURCE_NAMES)
LIBRARY = "gpt_fast_cpu_gemv_avx2"
# -ffp-contract=off: a product and a sum written apart stay two roundings, so that int4_dequantize_cpu gives
# PyTorch's numbers (the kernels' fused multiply-adds are written as such); -mf16c: float16 caches' loads (every CPU
# with AVX2 has F16C)
FLAGS = ["-O3", "-ffp-contract=off", "-mavx2", "-mfma", "-mf16c"]
CAPABILITIES = ("AVX2", "AVX512")  # torch.backends.cpu.get_cpu_capability() of a CPU with AVX2 and FMA
INT8_COLUMNS = 16  # the int8 kernel's inputs: a multiple of this
INT8_GROUPS = 16  # the grouped int8 kernel's group sizes: a multiple of this, dividing the inputs
INT4_COLUMNS = 64  # the int4 kernel's inputs: a multiple of this
INT4_GROUPS = 32  # the int4 kernel's group sizes: a multiple of this
Q8_BLOCK = 32  # columns of activations that share one scale in the q8 kernels: their inputs are a multiple of it
Q8_ROWS = 16  # the q8 kernels' weight rows per packed block (pack_int8_q8, pack_int4_q8): their outputs a multiple
BUILD_NOTE_SECONDS = 2.0  # a load slower than this compiled the library
STALE_LOCK_SECONDS = 600  # a build lock older than this was left by a build that did not finish (builds take ~20 s)


def cpu_kernels_usable() -> bool:
    """Whether this machine can build and run the kernels: an x86 CPU with AVX2 (and FMA, which every AVX2 CPU
    PyTorch dispatches to has), a C++ compiler and ninja."""
    from torch.utils.cpp_extension import is_ninja_available

    _put_ninja_on_path()
    compiler = os.environ.get("CXX", "c++")
    capability = torch.backends.cpu.get_cpu_capability()
    return capability in CAPABILITIES and shutil.which(compiler) is not None and is_ninja_available()


def _put_ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH; the ``ninja`` package that gpt-fast installs keeps it
    beside the environment's Python, on PATH only where the environment is activated."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load_cpu_kernels() -> None:
    """Build (the first time on this machine, some 20 s, said on standard error) and load the library that
    registers the operators (the products' and the decode attention's)."""
    from torch.utils.cpp_extension import _get_build_directory, load

    clear_stale_lock(Path(_get_build_directory(LIBRARY, verbose=False)))
    start = time.perf_counter()
    load(
        LIBRARY,
        sources=[str(source) for source in SOURCES],
        extra_cflags=FLAGS,
        is_python_module=False,
    )
    seconds = time.perf_counter() - start
    if seconds > BUILD_NOTE_SECONDS:
        print(f"Built gpt-fast's CPU kernels in {seconds:.1f} s (once on this machine)", file=sys.stderr)


def clear_stale_lock(build_dir: Path) -> None:
    """Remove the lock file that a build of the library into ``build_dir`` left behind when it was interrupted
    (Ctrl-C, a killed process): torch's extension builder waits, without end, for the lock a build holds, so every
    later load would hang. A lock older than :data:`STALE_LOCK_SECONDS` is such a one; saying so on standard error."""
    lock = build_dir / "lock"
    with contextlib.suppress(FileNotFoundError):
        age = time.time() - lock.stat().st_mtime
        if age > STALE_LOCK_SECONDS:
            lock.unlink()
            print(f"note: removed {lock}, left {age:.0f} s ago by a build that did not finish", file=sys.stderr)


def q8_vnni() -> bool:
    """Whether the q8 kernels take AVX512-VNNI's ``vpdpbusd`` here (the CPU has AVX512-F, BW, VL and VNNI, as the
    library reads its flags, and the kernels' AVX-512 code is on: ``set_avx512``); else AVX2's ``vpmaddubsw``, on the
    same packed weights: builds and loads the library first."""
    load_cpu_kernels()
    return bool(torch.ops.gpt_fast.q8_vnni())


def int8_q8_gemv(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """``x`` [M, K] float32 (K a multiple of :data:`Q8_BLOCK`, any M) rounded to int8 per block of 32 columns, times
    the int8 weights packed by :func:`pack_int8_q8` with scales per row (``group_size`` None) or per group of
    ``group_size`` columns (a multiple of 32): [M, N]. Each output differs from the product with ``x`` by the rounding
    of ``x``: at most half a level of each block (``max |x| / 254``) per column, times the weight."""
    return torch.ops.gpt_fast.int8_q8_gemv_cpu(x, words, scales, group_size or 0)


def pack_int8_q8(weight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 ``weight`` [N, K] (N a multiple of :data:`Q8_ROWS`, K of :data:`Q8_BLOCK`) with its ``scales`` [N] or
    [N, groups] as :func:`int8_q8_gemv` reads them: words [N / 16, K * 16] uint8, blocks of 16 rows by 32 columns
    whose 64-byte vector i holds, in the 4 bytes of row n, its columns 4 i .. 4 i + 3 as ``q + 128``; scales
    [N / 16, groups, 16] (one group for scales per row)."""
    rows, cols = weight.shape
    offset = weight.view(torch.uint8) ^ 0x80  # [N, K]: q + 128
    # [row block, row, column block, vector, byte] -> [row block, column block, vector, row, byte]
    words = offset.reshape(rows // Q8_ROWS, Q8_ROWS, cols // Q8_BLOCK, Q8_BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
    return words.reshape(rows // Q8_ROWS, -1).contiguous(), _by_block(scales.reshape(rows, -1))


def unpack_int8_q8(words: torch.Tensor, scales: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``index`` [...] of weights packed by :func:`pack_int8_q8` (a table's lookup): the int8 weights
    [..., K] and their scales [..., groups]."""
    blocks, cols = words.shape[0], words.shape[1] // Q8_ROWS
    view = words.view(blocks, cols // Q8_BLOCK, Q8_BLOCK // 4, Q8_ROWS, 4)  # see pack_int8_q8
    block, row = index // Q8_ROWS, index % Q8_ROWS
    picked = view[block, :, :, row]  # [..., column blocks, vector, byte]: the columns in order
    weight = (picked.reshape(*index.shape, cols) ^ 0x80).view(torch.int8)
    return weight, scales[block, :, row]


def _by_block(t: torch.Tensor) -> torch.Tensor:
    """Per-row values [N, G] as the packed kernels read them: [N / 16, G, 16]."""
    return t.reshape(t.shape[0] // Q8_ROWS, Q8_ROWS, -1).transpose(1, 2).contiguous()


def int4_q8_gemv(
    x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """As :func:`int4_gemv` (``group_size`` a multiple of 32) on the weights packed by :func:`pack_int4_q8`,
    with ``x`` [M, K] (any M) rounded to int8 per block of 32 columns in the products with the levels; the zero
    points multiply the sums of ``x`` itself: [M, N]."""
    return torch.ops.gpt_fast.int4_q8_gemv_cpu(x, words, scales, zeros, group_size)


def pack_int4_q8(
    weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int4 ``weight`` [N, K / 2] (column 2 t in the low nibble of byte t; N a multiple of :data:`Q8_ROWS`, K of
    :data:`Q8_BLOCK`) with its ``scales`` and ``zeros`` [N, groups] as :func:`int4_q8_gemv` reads them: words
    [N / 16, K * 8] uint8, blocks of 16 rows by 32 columns whose 64-byte vector i holds, in the 4 bytes of row n, its
    levels of columns 4 i .. 4 i + 3 in the low nibbles and 16 + 4 i .. in the high ones (one vpdpbusd multiplies 16
    rows' 4 columns after a mask or a shift); scales and zeros [N / 16, groups, 16]."""
    rows, cols = weight.shape[0], 2 * weight.shape[1]
    levels = torch.stack((weight & 0xF, weight >> 4), dim=-1).reshape(rows, cols)  # [N, K]
    # [row block, row, column block, half, vector, byte] -> [row block, column block, vector, row, byte, half]
    levels = levels.reshape(rows // Q8_ROWS, Q8_ROWS, cols // Q8_BLOCK, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    words = (levels[..., 0] | (levels[..., 1] << 4)).reshape(rows // Q8_ROWS, -1).contiguous()
    return words, _by_block(scales), _by_block(zeros)


def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] float32 times the int8 ``weight`` [N, K] (K a multiple of :data:`INT8_COLUMNS`) with
    ``scales`` [N] float32: [M, N]."""
    return torch.ops.gpt_fast.int8_gemv_cpu(x, weight, scales)


def int8_group_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x`` [M, K] float32 times the int8 ``weight`` [N, K] with ``scales`` [N, K / group_size] float32, one per
    group of ``group_size`` columns (a multiple of :data:`INT8_GROUPS` dividing K): [M, N]."""
    return torch.ops.gpt_fast.int8_group_gemv_cpu(x, weight, scales, group_size)


def int4_dequantize(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The int4 ``weight`` [N, K / 2] with ``scales`` and ``zeros`` [N, groups] float32 as the float32 matrix [N, K],
    the numbers :func:`gpt_fast.quant.products.int4_dequantize` gives, in one pass over threads."""
    return torch.ops.gpt_fast.int4_dequantize_cpu(weight, scales, zeros, group_size)


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """As :func:`int8_gemv` (``scales`` [N]) or :func:`int8_group_gemv` (``scales`` [N, K / group_size]), for a
    prompt's many rows: each thread dequantizes 16 weight rows at a time into its cache and multiplies them by
    every row of ``x``, in blocks of 3 rows by 4 outputs (with AVX-512, 4 by 4)."""
    return torch.ops.gpt_fast.int8_matmul_cpu(x, weight, scales, group_size or 0)


def int4_matmul(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """As :func:`int4_gemv`, for a prompt's many rows, as :func:`int8_matmul` computes them: the weights take the
    numbers :func:`int4_dequantize` gives them."""
    return torch.ops.gpt_fast.int4_matmul_cpu(x, weight, scales, zeros, group_size)


def int4_gemv(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``x`` [M, K] float32 (K a multiple of :data:`INT4_COLUMNS`) times the int4 ``weight`` [N, K / 2] (two
    columns a byte, the even one in the low nibble) with ``scales`` and ``zeros`` [N, groups] float32 (``group_size`` a
    multiple of :data:`INT4_GROUPS`; a level q stands for (q - 8) * scale + zero): [M, N]."""
    return torch.ops.gpt_fast.int4_gemv_cpu(x, weight, scales, zeros, group_size)
