"""Triton kernels for the decode step's quantized matrix-vector products (a few rows of activations against a
whole quantized weight matrix), where the time is the time to read the weights once.

Each program owns ``BLOCK_N`` output channels of one activation row and walks the input dimension, keeping a
partial product per loaded weight in registers and reducing once at the end, so that the loop body is loads,
conversions and fused multiply-adds only. Programs are numbered row-fastest: the programs of all activation rows
that read one block of weights run side by side, and all but the first find it in L2.

int4: each step covers ``GROUPS`` whole groups as a [BLOCK_N, GROUPS, ...] tile; the nibbles meet their
activation columns. With ``w = q * s + (zero - 8 s)`` per group, the scale multiplies the group's partial sums and
the offset only the sum of the group's activations, so the inner loop does no per-weight dequantization beyond
unpacking.

Two ways of reading the weights (``AS_WORDS``): as bytes converted by the hardware, and as 32-bit words whose
bytes or nibbles become floats through the mantissa of 2**23, which spares the
integer-to-float conversions (a quarter of the float multiply-add rate on recent NVIDIA GPUs) that would otherwise
bound the int4 kernel below the memory's speed. Which is faster, and which tile, is for
``scripts/quant_gemv.py --sweep`` to say on the GPU at hand.

Imported only where Triton is (:mod:`gpt_fast.quant.kernels` decides); the launchers run on CUDA tensors, and
in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Launch:
    """A kernel's tile: output channels per program, input columns per step (int4: whole groups), warps."""

    block_n: int
    block_k: int
    warps: int
    words: bool = False  # weights read as 32-bit words (where K is a multiple of 8)


@triton.jit
def _program_rows(M, BLOCK_N: tl.constexpr):
    """This program's activation row and output channels [BLOCK_N] (programs numbered row-fastest)."""
    pid = tl.program_id(0)
    return pid % M, (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _load(pointers, mask, EVEN: tl.constexpr):
    """A load, masked (zeros outside) unless the shapes are whole multiples of the tile."""
    if EVEN:
        value = tl.load(pointers)
    else:
        value = tl.load(pointers, mask=mask, other=0)
    return value


@triton.jit
def _group_scales(s_ptr, z_ptr, rn, g, N, NG, EVEN: tl.constexpr):
    """The scales and zeros [BLOCK_N, GROUPS] of channels ``rn``, groups ``g``, in float32."""
    at = rn[:, None] * NG + g[None, :]
    inside = (rn[:, None] < N) & (g[None, :] < NG)
    return _load(s_ptr + at, inside, EVEN).to(tl.float32), _load(z_ptr + at, inside, EVEN).to(tl.float32)


@triton.jit
def _store_int8(y_ptr, s_ptr, m, N, rn, acc):
    """Reduce the per-weight partial products [BLOCK_N, ...] of int8 rows, scale, store."""
    scales = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * N + rn, (tl.sum(acc, axis=1) * scales).to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _store_int4(y_ptr, m, N, rn, acc, acc_offset):
    """Reduce the scaled partial products [BLOCK_N, GROUPS, ...] and the offsets' terms [BLOCK_N, GROUPS], store."""
    y = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(acc_offset, axis=1)
    tl.store(y_ptr + m * N + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _int8_gemv(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    AS_WORDS: tl.constexpr,
):
    """int8 weights read a byte at a time and converted to float32 by the hardware, or (``AS_WORDS``, the weights
    given as int32) as 32-bit words of 4, each byte turned into a float by placing it, offset by 128, in the
    mantissa of 2**23: a logical operation and a subtraction, no integer-to-float conversion."""
    m, rn = _program_rows(M, BLOCK_N)
    x_row = x_ptr + m * K
    if AS_WORDS:
        WORDS: tl.constexpr = BLOCK_K // 4
        kw = K // 4
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * kw
        acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        for w0 in range(0, kw, WORDS):
            word = w0 + tl.arange(0, WORDS)
            packed = _load(w_rows + word[None, :], (rn[:, None] < N) & (word[None, :] < kw), EVEN)
            for i in tl.static_range(4):
                x = _load(x_row + 4 * word + i, word < kw, EVEN).to(tl.float32)
                biased = (((packed >> (8 * i)) & 0xFF) ^ 0x80) | 0x4B000000  # the bits of 2**23 + byte + 128
                acc += (biased.to(tl.float32, bitcast=True) - 8388736.0) * x[None, :]
        _store_int8(y_ptr, s_ptr, m, N, rn, acc)
    else:
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = _load(x_row + kk, kk < K, EVEN).to(tl.float32)
            w = _load(w_rows + kk[None, :], (rn[:, None] < N) & (kk[None, :] < K), EVEN)
            acc += w.to(tl.float32) * x[None, :]
        _store_int8(y_ptr, s_ptr, m, N, rn, acc)


@triton.jit
def _int4_gemv(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    NG,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN: tl.constexpr,
    AS_WORDS: tl.constexpr,
):
    """int4 weights read a byte (two columns) at a time, the nibbles converted to float32 by the hardware, or
    (``AS_WORDS``, the weights given as int32) as 32-bit words of 8 nibbles, each turned into a float through the
    mantissa of 2**23."""
    m, rn = _program_rows(M, BLOCK_N)
    x_row = x_ptr + m * K
    rg = tl.arange(0, GROUPS)
    acc_offset = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    if AS_WORDS:
        WORDS: tl.constexpr = GROUP // 8
        kw = K // 8  # words per weight row
        w_rows = w_ptr + rn.to(tl.int64)[:, None, None] * kw
        acc = tl.zeros((BLOCK_N, GROUPS, WORDS), dtype=tl.float32)
        for g0 in range(0, NG, GROUPS):
            g = g0 + rg
            word = g[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [GROUPS, WORDS]: index within the row
            packed = _load(w_rows + word[None, :, :], (rn[:, None, None] < N) & (word < kw)[None, :, :], EVEN)
            scales, zeros = _group_scales(s_ptr, z_ptr, rn, g, N, NG, EVEN)
            partial = tl.zeros((BLOCK_N, GROUPS, WORDS), dtype=tl.float32)
            x_sum = tl.zeros((GROUPS, WORDS), dtype=tl.float32)
            for i in tl.static_range(8):
                x = _load(x_row + 8 * word + i, word < kw, EVEN).to(tl.float32)
                level = (((packed >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                partial += level * x[None, :, :]
                x_sum += x
            acc += partial * scales[:, :, None]
            acc_offset += (zeros - 8.0 * scales) * tl.sum(x_sum, axis=1)[None, :]
        _store_int4(y_ptr, m, N, rn, acc, acc_offset)
    else:
        HALF: tl.constexpr = GROUP // 2
        kb = K // 2  # bytes per weight row
        w_rows = w_ptr + rn.to(tl.int64)[:, None, None] * kb
        acc = tl.zeros((BLOCK_N, GROUPS, HALF), dtype=tl.float32)
        for g0 in range(0, NG, GROUPS):
            g = g0 + rg
            byte = g[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [GROUPS, HALF]: index within the row
            x_even = _load(x_row + 2 * byte, byte < kb, EVEN).to(tl.float32)
            x_odd = _load(x_row + 2 * byte + 1, byte < kb, EVEN).to(tl.float32)
            packed = _load(w_rows + byte[None, :, :], (rn[:, None, None] < N) & (byte < kb)[None, :, :], EVEN)
            scales, zeros = _group_scales(s_ptr, z_ptr, rn, g, N, NG, EVEN)
            low = (packed & 0xF).to(tl.float32)
            high = (packed >> 4).to(tl.float32)
            acc += (low * x_even[None, :, :] + high * x_odd[None, :, :]) * scales[:, :, None]
            acc_offset += (zeros - 8.0 * scales) * tl.sum(x_even + x_odd, axis=1)[None, :]
        _store_int4(y_ptr, m, N, rn, acc, acc_offset)


def int8_launch(n: int, k: int) -> Launch:
    """The tile for an [n, k] int8 matrix: 2 rows of up to 1024 columns per program, 4 warps, so that each thread
    loads 16 bytes of each row per step and a 4096-row matrix makes 2048 programs (15 per multiprocessor of an
    H100). Chosen by reasoning, not measured: ``scripts/quant_gemv.py --sweep`` times the alternatives."""
    return Launch(2, min(1024, triton.next_power_of_2(k)), 4, words=True)


def int4_launch(n: int, k: int, group_size: int) -> Launch:
    """The tile for an [n, k] int4 matrix in groups of ``group_size``: 2 rows of up to 1024 columns (whole groups)
    per program, 2 warps (16 bytes per thread per row and step, as for int8). Not measured either."""
    return Launch(2, max(group_size, min(1024, triton.next_power_of_2(k))), 2, words=True)


Wrap = Callable[[Callable[..., None]], Callable[..., None]]  # torch.library.wrap_triton inside a triton_op


def _unwrapped(kernel: Callable[..., None]) -> Callable[..., None]:
    return kernel


def _prelude(x: torch.Tensor, n: int, launch: Launch) -> tuple[torch.Tensor, tuple[int], bool, bool]:
    """What both GEMVs set up for ``x`` [M, K] and ``n`` outputs: the output [M, N], the grid (one program per row
    and block of outputs), whether the blocks tile K and N exactly, and whether the weights are read as int32
    words."""
    m, k = x.shape
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    even = k % launch.block_k == 0 and n % launch.block_n == 0
    grid = (m * triton.cdiv(n, launch.block_n),)
    return y, grid, even, launch.words and k % 8 == 0


def int8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    launch: Launch | None = None,
    wrap: Wrap = _unwrapped,
) -> torch.Tensor:
    """``x`` [M, K] @ (``weight`` [N, K] int8 × ``scales`` [N]).T -> [M, N] in ``x``'s dtype."""
    m, k = x.shape
    n = weight.shape[0]
    launch = launch or int8_launch(n, k)
    y, grid, even, words = _prelude(x, n, launch)
    wrap(_int8_gemv)[grid](
        x,
        weight.view(torch.int32) if words else weight,
        scales,
        y,
        m,
        n,
        k,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        EVEN=even,
        AS_WORDS=words,
        num_warps=launch.warps,
    )
    return y


def int4_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    launch: Launch | None = None,
    wrap: Wrap = _unwrapped,
) -> torch.Tensor:
    """``x`` [M, K] @ dequantized(``weight`` [N, K/2] uint8, ``scales``/``zeros`` [N, G]).T -> [M, N]."""
    m, k = x.shape
    n, n_groups = scales.shape
    launch = launch or int4_launch(n, k, group_size)
    groups = launch.block_k // group_size
    y, grid, even, words = _prelude(x, n, launch)
    wrap(_int4_gemv)[grid](
        x,
        weight.view(torch.int32) if words else weight,
        scales,
        zeros,
        y,
        m,
        n,
        k,
        n_groups,
        BLOCK_N=launch.block_n,
        GROUPS=groups,
        GROUP=group_size,
        EVEN=even,
        AS_WORDS=words,
        num_warps=launch.warps,
    )
    return y
