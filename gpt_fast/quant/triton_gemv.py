"""Triton kernels for the decode step's quantized matrix-vector products (a few rows of activations against a
whole quantized weight matrix), where the time is the time to read the weights once.

Each program owns ``BLOCK_N`` output channels of one activation row and walks the input dimension, keeping a
partial product per loaded weight in registers and reducing once at the end, so that the loop body is loads,
conversions and fused multiply-adds only. Programs are numbered row-fastest: the programs of all activation rows
that read one block of weights run side by side, and all but the first find it in L2.

int4: the weights are repacked once (:func:`gpt_fast.quant.kernels.group_interleave`) so that each 32-bit word
holds 8 columns of one group that meet contiguous activations; each step covers ``GROUPS`` whole groups as a
[BLOCK_N, GROUPS, words] tile. The scale multiplies the group's partial sums and the zero point only the sum of
the group's activations. With float32 activations each weight costs a shift, a logical operation and a float
multiply-add; with 16-bit ones (``half2``) two nibbles become float16 at once and each word's eight products are
summed in float16 pairs by inline PTX, about half the instructions per weight (see :func:`_int4_gemv`). The PTX is
NVIDIA's: ROCm builds do not use these kernels (:func:`gpt_fast.quant.kernels.triton_usable`).

int8: the weights are read as bytes converted by the hardware, or (``AS_WORDS``) as 32-bit words whose bytes
become floats in the mantissa of 1.0 as int4's nibbles do (a shift and a logical operation per weight), which spares
the integer-to-float conversions (a quarter of the float multiply-add rate on recent NVIDIA GPUs) and a
subtraction. Which is faster, and which tile, is for ``scripts/quant_gemv.py --sweep`` to say on the GPU at hand.

Imported only where Triton is (:mod:`gpt_fast.quant.kernels` decides); the launchers run on CUDA tensors, and
in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpt_fast.triton_pdl import pdl_launch, wait_for_inputs


@dataclass(frozen=True)
class Launch:
    """A kernel's tile: output channels per program, input columns per step (int4: whole groups), warps."""

    block_n: int
    block_k: int
    warps: int
    words: bool = False  # int8: weights read as 32-bit words (where K is a multiple of 8)
    half2: bool = False  # int4: products summed in float16 pairs (where x is 16-bit)


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
def _int8_words(w_rows, rn, word, N, kw, EVEN: tl.constexpr):
    """The int8 weights of channels ``rn`` [BLOCK_N] as 32-bit words ``word`` [WORDS] (zeros outside)."""
    return _load(w_rows + word[None, :], (rn[:, None] < N) & (word[None, :] < kw), EVEN)


@triton.jit
def _int8_word_step(packed, x_row, word, kw, ONE_SIGN, acc, x_sum, EVEN: tl.constexpr):
    """One step of :func:`_int8_gemv` over the words ``packed`` [BLOCK_N, WORDS]: the new ``acc`` and ``x_sum``."""
    for i in tl.static_range(4):
        x = _load(x_row + 4 * word + i, word < kw, EVEN).to(tl.float32)
        if 8 * i <= 15:
            moved = packed << (15 - 8 * i)
        else:
            moved = packed >> (8 * i - 15)
        acc += ((moved & 0x007F8000) ^ ONE_SIGN).to(tl.float32, bitcast=True) * x[None, :]
        x_sum += x
    return acc, x_sum


@triton.jit
def _int4_words(w_rows, rn, g, rj, N, NG, WORDS: tl.constexpr, EVEN: tl.constexpr):
    """The int4 words [BLOCK_N, GROUPS, WORDS] of channels ``rn``, groups ``g`` (zeros outside)."""
    word = g[:, None] * WORDS + rj[None, :]  # [GROUPS, WORDS]: index within the row
    return _load(w_rows + word[None, :, :], (rn[:, None, None] < N) & (g < NG)[None, :, None], EVEN)


@triton.jit
def _activations(x_row, col, K, EVEN: tl.constexpr):
    """The activations of row ``x_row`` at columns ``col`` (zeros past ``K``), in float32."""
    return _load(x_row + col, col < K, EVEN).to(tl.float32)


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
    ONE_SIGN,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,
    AS_WORDS: tl.constexpr,
    PDL: tl.constexpr,
):
    """int8 weights read a byte at a time and converted to float32 by the hardware, or (``AS_WORDS``, the weights
    given as int32) as 32-bit words of 4, each byte ``q`` becoming the float ``1 + (q + 128) / 256`` as in the int4
    kernel: moved to bits 15-22, its sign bit flipped and the exponent bits of 1.0 set by one logical operation
    with ``ONE_SIGN`` (an argument, held in a register), a shift and that operation per weight, no conversion and no
    subtraction. The row's sum is then ``256 * sum(v x) - 384 * sum(x)``. The first step's words are loaded before
    the wait for the activations (``PDL``, :mod:`gpt_fast.triton_pdl`)."""
    m, rn = _program_rows(M, BLOCK_N)
    x_row = x_ptr + m * K
    if AS_WORDS:
        WORDS: tl.constexpr = BLOCK_K // 4
        kw = K // 4
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * kw
        acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        x_sum = tl.zeros((WORDS,), dtype=tl.float32)
        word = tl.arange(0, WORDS)
        packed = _int8_words(w_rows, rn, word, N, kw, EVEN)
        wait_for_inputs(PDL)
        acc, x_sum = _int8_word_step(packed, x_row, word, kw, ONE_SIGN, acc, x_sum, EVEN)
        for w0 in range(WORDS, kw, WORDS):
            word = w0 + tl.arange(0, WORDS)
            packed = _int8_words(w_rows, rn, word, N, kw, EVEN)
            acc, x_sum = _int8_word_step(packed, x_row, word, kw, ONE_SIGN, acc, x_sum, EVEN)
        _store_int8(y_ptr, s_ptr, m, N, rn, 256.0 * acc - 384.0 * x_sum[None, :])
    else:
        wait_for_inputs(PDL)
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = _load(x_row + kk, kk < K, EVEN).to(tl.float32)
            w = _load(w_rows + kk[None, :], (rn[:, None] < N) & (kk[None, :] < K), EVEN)
            acc += w.to(tl.float32) * x[None, :]
        _store_int8(y_ptr, s_ptr, m, N, rn, acc)


# Four pairs of nibbles of a 32-bit word (0 and 4, 1 and 5, 2 and 6, 3 and 7 in the halves of a register) become
# float16 pairs 1024 + q (the low nibble of each byte) or 1024 + 16 q (the high one) by one logical operation,
# then exactly (q - 8) / 64 by one packed multiply-add, and meet the matching pairs of activations ($2 to $5) in a
# chain of packed multiply-adds; the two halves of the sum end as one float32. Per word: a shift, four logical
# operations, eight packed multiply-adds, two conversions and an addition, where the float32 path takes a shift,
# a logical operation and a multiply-add per nibble. The scale 1/64 keeps every partial sum of an activation
# below 65504 up to |x| = 65504, where float16 itself ends, and every product of |x| >= 4e-3 a normal number.
_NIBBLE_DOT_PTX = tl.constexpr(
    " ".join(  # one line: inductor copies it into the Python it generates for a compiled step
        [
            "{",
            ".reg .b32 s, t0, t1, t2, t3, low_scale, low_offset, high_scale, high_offset, acc;",
            ".reg .b16 lo, hi;",
            ".reg .f32 flo, fhi;",
            "mov.b32 low_scale, 0x24002400;",
            "mov.b32 low_offset, 0xCC08CC08;",
            "mov.b32 high_scale, 0x14001400;",
            "mov.b32 high_offset, 0xBC80BC80;",
            "shr.b32 s, $1, 8;",
            "lop3.b32 t0, $1, 0x000F000F, 0x64006400, 0xEA;",
            "lop3.b32 t1, $1, 0x00F000F0, 0x64006400, 0xEA;",
            "lop3.b32 t2, s, 0x000F000F, 0x64006400, 0xEA;",
            "lop3.b32 t3, s, 0x00F000F0, 0x64006400, 0xEA;",
            "fma.rn.f16x2 t0, t0, low_scale, low_offset;",
            "fma.rn.f16x2 t1, t1, high_scale, high_offset;",
            "fma.rn.f16x2 t2, t2, low_scale, low_offset;",
            "fma.rn.f16x2 t3, t3, high_scale, high_offset;",
            "mul.rn.f16x2 acc, t0, $2;",
            "fma.rn.f16x2 acc, t1, $3, acc;",
            "fma.rn.f16x2 acc, t2, $4, acc;",
            "fma.rn.f16x2 acc, t3, $5, acc;",
            "mov.b32 {lo, hi}, acc;",
            "cvt.f32.f16 flo, lo;",
            "cvt.f32.f16 fhi, hi;",
            "add.f32 $0, flo, fhi;",
            "}",
        ]
    )
)
HALF2_SCALE = tl.constexpr(64.0)  # the packed path's nibbles are (q - 8) / 64


@triton.jit
def _half2(low, high):
    """float32 ``low`` and ``high`` as the halves of one float16 pair (a 32-bit integer)."""
    return tl.inline_asm_elementwise(
        "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,r,r", [high, low], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _nibble_dot(packed, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """``sum_i (q_i - 8) / 64 * x_i`` [BLOCK_N, GROUPS, WORDS] over the nibbles ``q_i`` of each word of ``packed``
    and the activations ``x_i`` [GROUPS, WORDS] they meet, in float16 pairs (:data:`_NIBBLE_DOT_PTX`); without
    ``ASM`` (Triton's interpreter, which runs no PTX) the same float16 arithmetic one nibble at a time."""
    if ASM:
        pairs = [packed, _half2(x0, x4), _half2(x1, x5), _half2(x2, x6), _half2(x3, x7)]
        out = tl.inline_asm_elementwise(_NIBBLE_DOT_PTX, "=r,r,r,r,r,r", pairs, dtype=tl.float32, is_pure=True, pack=1)
    else:
        low = _nibble_term(packed, 0, x0) + _nibble_term(packed, 1, x1)
        low = low + _nibble_term(packed, 2, x2) + _nibble_term(packed, 3, x3)
        high = _nibble_term(packed, 4, x4) + _nibble_term(packed, 5, x5)
        high = high + _nibble_term(packed, 6, x6) + _nibble_term(packed, 7, x7)
        out = low.to(tl.float32) + high.to(tl.float32)
    return out


@triton.jit
def _nibble_term(packed, i: tl.constexpr, x):
    """(q_i - 8) / 64 * x in float16, for :func:`_nibble_dot` without PTX."""
    q = ((packed >> (4 * i)) & 0xF) - 8
    return (q.to(tl.float16) / HALF2_SCALE) * x.to(tl.float16)[None, :, :]


@triton.jit
def _int4_step(
    packed,
    x_row,
    s_ptr,
    z_ptr,
    rn,
    g,
    rj,
    N,
    K,
    NG,
    ONE,
    acc,
    acc_offset,
    GROUP: tl.constexpr,
    EVEN: tl.constexpr,
    HALF2: tl.constexpr,
    ASM: tl.constexpr,
):
    """One step of :func:`_int4_gemv` over the words ``packed`` [BLOCK_N, GROUPS, WORDS] of groups ``g``: the new
    ``acc`` and ``acc_offset``."""
    WORDS: tl.constexpr = GROUP // 8
    scales, zeros = _group_scales(s_ptr, z_ptr, rn, g, N, NG, EVEN)
    col = g[:, None] * GROUP + rj[None, :]  # [GROUPS, WORDS]: the columns nibble 0 meets
    if HALF2:
        x0 = _activations(x_row, col, K, EVEN)
        x1 = _activations(x_row, col + WORDS, K, EVEN)
        x2 = _activations(x_row, col + 2 * WORDS, K, EVEN)
        x3 = _activations(x_row, col + 3 * WORDS, K, EVEN)
        x4 = _activations(x_row, col + 4 * WORDS, K, EVEN)
        x5 = _activations(x_row, col + 5 * WORDS, K, EVEN)
        x6 = _activations(x_row, col + 6 * WORDS, K, EVEN)
        x7 = _activations(x_row, col + 7 * WORDS, K, EVEN)
        acc += _nibble_dot(packed, x0, x1, x2, x3, x4, x5, x6, x7, ASM) * scales[:, :, None]
        x_sum = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
        acc_offset += zeros * tl.sum(x_sum, axis=1)[None, :]
    else:
        partial = tl.zeros(packed.shape, dtype=tl.float32)
        x_sum = tl.zeros(col.shape, dtype=tl.float32)
        for i in tl.static_range(8):
            x = _activations(x_row, col + i * WORDS, K, EVEN)
            if 4 * i <= 16:
                moved = packed << (16 - 4 * i)
            else:
                moved = packed >> (4 * i - 16)
            partial += ((moved & 0x000F0000) | ONE).to(tl.float32, bitcast=True) * x[None, :, :]
            x_sum += x
        acc += partial * (128.0 * scales)[:, :, None]
        acc_offset += (zeros - (128.0 + 8.0) * scales) * tl.sum(x_sum, axis=1)[None, :]
    return acc, acc_offset


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
    ONE,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN: tl.constexpr,
    HALF2: tl.constexpr,
    ASM: tl.constexpr,
    PDL: tl.constexpr,
):
    """int4 weights in the words of :func:`gpt_fast.quant.kernels.group_interleave`: nibble ``i`` of a group's
    word ``j`` is the group's column ``i * GROUP / 8 + j``, so that the activations each nibble position meets
    are contiguous (vector loads, shared by the ``BLOCK_N`` rows). With ``w = (q - 8) s + zero`` per group, the
    group's sum is ``s * sum((q - 8) x) + zero * sum(x)``.

    float32 (not ``HALF2``): a nibble becomes the float ``1 + q / 128`` by moving it to bits 16-19 and setting the
    exponent bits of 1.0 (``ONE``, an argument: held in a register, the mask and the exponent bits take one logical
    instruction, where two constants take two): a shift and a logical operation per weight, no conversion and no
    subtraction; the group's sum is then ``128 s * sum(v x) + (zero - 136 s) * sum(x)``.

    ``HALF2``: each word's eight products are summed in float16 pairs (:func:`_nibble_dot`), about half the
    instructions per weight, at float16's precision over eight terms before the float32 sum.

    Either way the first step's words are loaded before the wait for the activations (``PDL``,
    :mod:`gpt_fast.triton_pdl`)."""
    m, rn = _program_rows(M, BLOCK_N)
    x_row = x_ptr + m * K
    WORDS: tl.constexpr = GROUP // 8  # words per row and group
    rg = tl.arange(0, GROUPS)
    rj = tl.arange(0, WORDS)
    w_rows = w_ptr + rn.to(tl.int64)[:, None, None] * (NG * WORDS)
    acc = tl.zeros((BLOCK_N, GROUPS, WORDS), dtype=tl.float32)
    acc_offset = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    packed = _int4_words(w_rows, rn, rg, rj, N, NG, WORDS, EVEN)
    wait_for_inputs(PDL)
    acc, acc_offset = _int4_step(
        packed, x_row, s_ptr, z_ptr, rn, rg, rj, N, K, NG, ONE, acc, acc_offset, GROUP, EVEN, HALF2, ASM
    )
    for g0 in range(GROUPS, NG, GROUPS):
        g = g0 + rg
        packed = _int4_words(w_rows, rn, g, rj, N, NG, WORDS, EVEN)
        acc, acc_offset = _int4_step(
            packed, x_row, s_ptr, z_ptr, rn, g, rj, N, K, NG, ONE, acc, acc_offset, GROUP, EVEN, HALF2, ASM
        )
    if HALF2:
        acc = acc * HALF2_SCALE
    _store_int4(y_ptr, m, N, rn, acc, acc_offset)


ONE_SIGN_BITS = 0x3FC00000  # the float 1.0 and the sign bit of a byte at bits 15-22 (see _int8_gemv)


def int8_launch(n: int, k: int) -> Launch:
    """The tile for an [n, k] int8 matrix: 8 rows of up to 2048 columns per program (read as int32 words), 4
    warps. The best single tile of ``scripts/quant_gemv.py --sweep`` on an H200 (BENCHMARKS.md, fifth session's
    raw sweep): 70.4 us for a Llama-2-7B layer's four GEMVs against 94.2 us for the tile used before (2 rows of
    1024 columns), and within 10 % of each matrix's own best tile."""
    return Launch(8, min(2048, triton.next_power_of_2(k)), 4, words=True)


Wrap = Callable[[Callable[..., None]], Callable[..., None]]  # torch.library.wrap_triton inside a triton_op


def _unwrapped(kernel: Callable[..., None]) -> Callable[..., None]:
    return kernel


def _prelude(x: torch.Tensor, n: int, launch: Launch) -> tuple[torch.Tensor, tuple[int], bool, bool]:
    """What both GEMVs set up for ``x`` [M, K] and ``n`` outputs: the output [M, N], the grid (one program per row
    and block of outputs), whether the blocks tile K and N exactly, and whether int8 weights are read as int32
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
    pdl: bool = False,
) -> torch.Tensor:
    """``x`` [M, K] @ (``weight`` [N, K] int8 × ``scales`` [N]).T -> [M, N] in ``x``'s dtype; ``pdl``: launched
    with programmatic dependent launch where the GPU has it."""
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
        ONE_SIGN_BITS,
        BLOCK_N=launch.block_n,
        BLOCK_K=launch.block_k,
        EVEN=even,
        AS_WORDS=words,
        num_warps=launch.warps,
        **pdl_launch(x.device, pdl),
    )
    return y


ONE_BITS = 0x3F800000  # the float 1.0 (see _int4_gemv)
WIDE_ROWS = 8192  # float32 int4 matrices of at least this many rows take taller tiles (int4_launch)
HALF2_WIDE_ROWS = 16384  # 16-bit int4 matrices of at least this many rows take shorter steps (int4_launch)


def int4_launch(n: int, group_size: int, half2: bool = True) -> Launch:
    """The tile for an int4 matrix of n rows, from ``scripts/quant_gemv.py --sweep`` on an H200 (BENCHMARKS.md):

    - ``half2`` (16-bit activations; products summed in float16 pairs): 16 rows, 2 groups per step and one warp for
      the widest matrices (Llama-2-7B's ``w13`` and output head), otherwise 8 rows, 8 groups and 4 warps (the best
      single tile over a Llama-2-7B layer's four matrices; twenty-third session);
    - float32 activations: 8 groups per step and one warp; 8 rows per program for a wide matrix, 1 for a narrower
      one (the best summed times of each set; twelfth session)."""
    if half2:
        return (
            Launch(16, 2 * group_size, 1, half2=True)
            if n >= HALF2_WIDE_ROWS
            else Launch(8, 8 * group_size, 4, half2=True)
        )
    return Launch(8 if n >= WIDE_ROWS else 1, 8 * group_size, 1)


def int4_gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    launch: Launch | None = None,
    wrap: Wrap = _unwrapped,
    pdl: bool = False,
) -> torch.Tensor:
    """``x`` [M, K] @ dequantized(``words`` [N, G * group_size / 8] int32, ``scales``/``zeros`` [N, G]).T ->
    [M, N]; ``words`` from :func:`gpt_fast.quant.kernels.group_interleave`; ``pdl`` as for :func:`int8_gemv`."""
    m, k = x.shape
    n, n_groups = scales.shape
    half2 = x.dtype != torch.float32  # 16-bit activations: float16 pairs where the tile asks for them
    launch = launch or int4_launch(n, group_size, half2)
    y, grid, even, _ = _prelude(x, n, launch)
    wrap(_int4_gemv)[grid](
        x,
        words,
        scales,
        zeros,
        y,
        m,
        n,
        k,
        n_groups,
        ONE_BITS,
        BLOCK_N=launch.block_n,
        GROUPS=launch.block_k // group_size,
        GROUP=group_size,
        EVEN=even,
        HALF2=launch.half2 and half2,
        ASM=x.is_cuda,
        num_warps=launch.warps,
        **pdl_launch(x.device, pdl),
    )
    return y
