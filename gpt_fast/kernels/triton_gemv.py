"""Triton kernels for the decode step's quantized matrix-vector products (a few rows of activations against a
whole quantized weight matrix), where the time is the time to read the weights once.

Each program owns ``BLOCK_N`` output channels of one activation row and walks the input dimension, keeping a
partial product per loaded weight in registers and reducing once at the end, so that the loop body is loads,
conversions and fused multiply-adds only. Programs are numbered row-fastest: the programs of all activation rows
that read one block of weights run side by side, and all but the first find it in L2.

int4: the weights are repacked once (:func:`gpt_fast.quant.products.group_interleave`) so that each 32-bit word
holds 8 columns of one group, in pairs that meet 32-bit pairs of 16-bit activations, and are read two words at a
time (64 bits); each step covers ``GROUPS`` whole groups as a [GROUPS, BLOCK_N, word pairs] tile, each thread
holding its word pairs for all the tile's channels. The scale multiplies each word pair's partial sum and the zero
point the sum of its activations. With float32 activations each weight costs a shift, a logical operation and a
float multiply-add; with 16-bit ones (``half2``) two nibbles become float16 at once and two words' products are
summed in float16 pairs by inline PTX, about half the instructions per weight (see :func:`_int4_gemv`). The PTX is
NVIDIA's: ROCm builds do not use these kernels (:func:`gpt_fast.kernels.available.triton_usable`).

int8 with 16-bit activations: the weights are repacked once (:func:`gpt_fast.quant.products.int8_interleave`, where
the columns are a multiple of 64) into 64-bit elements of two words, each byte offset to ``q + 128``, so that a
word's four columns meet one 64-bit quad of activations and the quads that consecutive elements meet are contiguous
(a tile laid out as int4's). A byte permute makes two bytes one float16 pair (``1024 + q + 128``, exact), one packed
multiply-add makes it exactly ``q / 256``, a second meets the activations (:data:`_BYTE_PAIRS_PTX`): two
instructions per weight. Otherwise (float32 activations, other widths) the matrix is read as it is: as bytes
converted by the hardware, or (``AS_WORDS``) as 32-bit words whose bytes become floats in the mantissa of 1.0 as
int4's nibbles do (a shift and a logical operation per weight), which spares the integer-to-float conversions (a
quarter of the float multiply-add rate on recent NVIDIA GPUs) and a subtraction. Which tile is for
``scripts/quant_gemv.py --sweep`` to say on the GPU at hand.

Imported only where Triton is (:mod:`gpt_fast.quant.products` decides); the launchers run on CUDA tensors, and
in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpt_fast.kernels.pdl import Wrap, pdl_launch, unwrapped, wait_for_inputs
from gpt_fast.kernels.row import ACTIVATIONS, checked_norm_weight, gated, inverse_rms


@dataclass(frozen=True)
class Launch:
    """A kernel's tile: output channels per program, input columns per step (int4: whole groups), warps."""

    block_n: int
    block_k: int
    warps: int
    words: bool = False  # int8 as it is: the matrix read as 32-bit words (where K is a multiple of 8)
    half2: bool = False  # int4: products summed in float16 pairs (where x is 16-bit)
    stages: int | None = None  # Triton's software pipelining of the loop over K (num_stages); None: its default

    def compile_options(self) -> dict[str, int]:
        """The launch's ``num_warps``, and ``num_stages`` where the tile sets it."""
        return {"num_warps": self.warps} | ({} if self.stages is None else {"num_stages": self.stages})


@dataclass(frozen=True, eq=False)
class Inside:
    """What a decode step's product takes inside its kernel besides the product, so that none is a kernel of its
    own (:func:`_int4_gemv`): the RMSNorm of its input (``norm_weight`` [K], ``eps``), the residual [M, N] added
    to it, or (``activation``, ``silu`` or ``gelu_tanh``) a gated MLP's activation of its gate and up rows."""

    norm_weight: torch.Tensor | None = None
    eps: float = 0.0
    residual: torch.Tensor | None = None
    activation: str | None = None

    def empty(self) -> bool:
        return self.norm_weight is None and self.residual is None and self.activation is None

    def arguments(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, object]:
        """The kernels' arguments for ``x`` [M, K] and the output ``y``."""
        residual, activation = self.residual, self.activation
        assert activation is None or (activation in ACTIVATIONS and residual is None)
        assert residual is None or (
            residual.shape == y.shape and residual.is_contiguous() and residual.dtype == x.dtype
        )
        return {
            "r_ptr": y if residual is None else residual,  # not read without a residual
            "g_ptr": checked_norm_weight(x, self.norm_weight, y),
            "eps": self.eps,
            "NORM": self.norm_weight is not None,
            "RESIDUAL": residual is not None,
            "GATED": activation is not None,
            "GELU": activation == "gelu_tanh",
            "ROW_K": triton.next_power_of_2(x.shape[1]),
        }


NOTHING_INSIDE = Inside()


@triton.jit
def _program_rows(M, N, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """This program's activation row and weight rows [BLOCK_N] (programs numbered row-fastest): ``BLOCK_N``
    consecutive rows, or with ``GATED`` (a gated MLP's ``w13`` of N rows, gate rows then up rows) the gate and the
    up row of each of ``BLOCK_N / 2`` consecutive hidden units, in pairs."""
    pid = tl.program_id(0)
    if GATED:
        j = tl.arange(0, BLOCK_N)
        rows = (pid // M) * (BLOCK_N // 2) + j // 2 + (j % 2) * (N // 2)
    else:
        rows = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid % M, rows


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
def _store_rows(
    y_ptr,
    r_ptr,
    m,
    N,
    rn,
    y,
    RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Store row ``m``'s products ``y`` [BLOCK_N] (float32) of the weight rows ``rn`` into ``y`` [M, N] in its
    dtype; with ``RESIDUAL``, each rounded and added to ``r`` [M, N], rounded again; with ``GATED`` (rows from
    :func:`_program_rows`), ``act(gate) * up`` of each pair, each rounded first (as the model's ``w13`` output is),
    into ``y`` [M, N / 2]."""
    dtype = y_ptr.dtype.element_ty
    if GATED:
        gate, up = tl.split(tl.reshape(y.to(dtype).to(tl.float32), (BLOCK_N // 2, 2)))
        units, _ = tl.split(tl.reshape(rn, (BLOCK_N // 2, 2)))  # a unit's gate row is the unit
        tl.store(y_ptr + m * (N // 2) + units, gated(gate, up, dtype, GELU), mask=units < N // 2)
    else:
        if RESIDUAL:
            y = y.to(dtype).to(tl.float32) + tl.load(r_ptr + m * N + rn, mask=rn < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * N + rn, y.to(dtype), mask=rn < N)


@triton.jit
def _store_int8(
    y_ptr,
    s_ptr,
    r_ptr,
    m,
    N,
    rn,
    acc,
    RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Reduce the per-weight partial products [BLOCK_N, ...] of int8 rows, scale, store (:func:`_store_rows`)."""
    scales = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    _store_rows(y_ptr, r_ptr, m, N, rn, tl.sum(acc, axis=1) * scales, RESIDUAL, GATED, GELU, BLOCK_N)


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
    the wait for the activations (``PDL``, :mod:`gpt_fast.kernels.pdl`)."""
    m, rn = _program_rows(M, N, BLOCK_N, False)
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
        _store_int8(y_ptr, s_ptr, y_ptr, m, N, rn, 256.0 * acc - 384.0 * x_sum[None, :], False, False, False, BLOCK_N)
    else:
        wait_for_inputs(PDL)
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            x = _load(x_row + kk, kk < K, EVEN).to(tl.float32)
            w = _load(w_rows + kk[None, :], (rn[:, None] < N) & (kk[None, :] < K), EVEN)
            acc += w.to(tl.float32) * x[None, :]
        _store_int8(y_ptr, s_ptr, y_ptr, m, N, rn, acc, False, False, False, BLOCK_N)


def ptx_block(*lines: str) -> tl.constexpr:
    """One PTX block of ``lines`` for ``tl.inline_asm_elementwise``, on one line: inductor copies it into the
    Python it generates for a compiled step."""
    return tl.constexpr(" ".join(["{", *lines, "}"]))


# The float16 pair ``h`` as two float32 halves, ``flo`` and ``fhi``: how both float16-pairs blocks end.
_PAIR_TO_FLOAT32 = ["mov.b32 {lo, hi}, h;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;"]


def _word_terms(word: str, pairs: list[str], first: bool) -> list[str]:
    """PTX for one word of :data:`_WORD_PAIR_PTX`: its four nibble pairs become float16 pairs ``1024 + q`` (a
    byte's low nibble) or ``1024 + 16 q`` (its high one) by one logical operation each, then exactly ``(q - 8) /
    64`` by one packed multiply-add, then meet the word's activation ``pairs`` in the running float16-pair sum
    ``h``."""
    start = f"mul.rn.f16x2 h, t0, {pairs[0]};" if first else f"fma.rn.f16x2 h, t0, {pairs[0]}, h;"
    return [
        f"shr.b32 s, {word}, 8;",
        f"lop3.b32 t0, {word}, 0x000F000F, 0x64006400, 0xEA;",
        f"lop3.b32 t1, {word}, 0x00F000F0, 0x64006400, 0xEA;",
        "lop3.b32 t2, s, 0x000F000F, 0x64006400, 0xEA;",
        "lop3.b32 t3, s, 0x00F000F0, 0x64006400, 0xEA;",
        "fma.rn.f16x2 t0, t0, low_scale, low_offset;",
        "fma.rn.f16x2 t1, t1, high_scale, high_offset;",
        "fma.rn.f16x2 t2, t2, low_scale, low_offset;",
        "fma.rn.f16x2 t3, t3, high_scale, high_offset;",
        start,
        f"fma.rn.f16x2 h, t1, {pairs[1]}, h;",
        f"fma.rn.f16x2 h, t2, {pairs[2]}, h;",
        f"fma.rn.f16x2 h, t3, {pairs[3]}, h;",
    ]


# Two words (a 64-bit $2) against their activation pairs ($3-$6: the k-th pair of both words, as float16 pairs),
# summed in float16 pairs; the sum ends as one float32 that adds, times the scale ($7), to the accumulator ($1),
# with the zero point ($8) times the words' activation sum ($9). Per word: a shift, four logical operations and
# eight packed multiply-adds, where the float32 path takes a shift, a logical operation and a multiply-add per
# nibble. The scale 1/64 keeps the sixteen products' partial sums below 65504 up to |x| = 32752 (each at most |x| /
# 8), and every product of |x| >= 4e-3 a normal number.
_WORD_PAIR_PTX = ptx_block(
    ".reg .b32 w0, w1, a0, b0, a1, b1, a2, b2, a3, b3;",
    ".reg .b32 s, t0, t1, t2, t3, low_scale, low_offset, high_scale, high_offset, h;",
    ".reg .b16 lo, hi;",
    ".reg .f32 flo, fhi, d;",
    "mov.b64 {w0, w1}, $2;",
    "mov.b64 {a0, b0}, $3;",
    "mov.b64 {a1, b1}, $4;",
    "mov.b64 {a2, b2}, $5;",
    "mov.b64 {a3, b3}, $6;",
    "mov.b32 low_scale, 0x24002400;",
    "mov.b32 low_offset, 0xCC08CC08;",
    "mov.b32 high_scale, 0x14001400;",
    "mov.b32 high_offset, 0xBC80BC80;",
    *_word_terms("w0", ["a0", "a1", "a2", "a3"], True),
    *_word_terms("w1", ["b0", "b1", "b2", "b3"], False),
    *_PAIR_TO_FLOAT32,
    "add.f32 d, flo, fhi;",
    "fma.rn.f32 d, d, $7, $1;",
    "fma.rn.f32 $0, $9, $8, d;",
)
# Two bfloat16 pairs as two float16 pairs: each half moved to the top of a float32 (exact), each pair rounded at once.
_BF16_PAIRS_PTX = ptx_block(
    ".reg .b32 a, b, lo, hi, ra, rb;",
    "mov.b64 {a, b}, $1;",
    "shl.b32 lo, a, 16;",
    "and.b32 hi, a, 0xFFFF0000;",
    "cvt.rn.f16x2.f32 ra, hi, lo;",
    "shl.b32 lo, b, 16;",
    "and.b32 hi, b, 0xFFFF0000;",
    "cvt.rn.f16x2.f32 rb, hi, lo;",
    "mov.b64 $0, {ra, rb};",
)
# The sum of a word pair's sixteen activations ($1-$4: the four 64-bit quads of float16 pairs it meets), each an
# eighth (exact, but below float16's normal range), summed in float16 pairs, then times 8 in float32: eight instead
# of one conversion and one float32 addition per activation. Sums of eight eighths of |x| <= 32752 stay below 65504.
_EIGHTHS_SUM_PTX = ptx_block(
    ".reg .b32 a0, b0, a1, b1, a2, b2, a3, b3, eighth, h;",
    ".reg .b16 lo, hi;",
    ".reg .f32 flo, fhi;",
    "mov.b64 {a0, b0}, $1;",
    "mov.b64 {a1, b1}, $2;",
    "mov.b64 {a2, b2}, $3;",
    "mov.b64 {a3, b3}, $4;",
    "mov.b32 eighth, 0x30003000;",
    "mul.rn.f16x2 h, a0, eighth;",
    *[f"fma.rn.f16x2 h, {pair}, eighth, h;" for pair in ("b0", "a1", "b1", "a2", "b2", "a3", "b3")],
    *_PAIR_TO_FLOAT32,
    "add.f32 flo, flo, fhi;",
    "mul.f32 $0, flo, 0f41000000;",
)
HALF2_SCALE = tl.constexpr(64.0)  # the packed path's nibbles are (q - 8) / 64


@triton.jit
def _split(v):
    """64-bit ``v`` as its low and high 32-bit halves."""
    return v.to(tl.int32), (v >> 32).to(tl.int32)


@triton.jit
def _activation(quad, i: tl.constexpr, BF16: tl.constexpr):
    """The ``i``-th 16-bit activation of ``quad`` (64 bits, or a 32-bit pair), in float32."""
    kind: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    return (quad >> (16 * i)).to(tl.int16).to(kind, bitcast=True).to(tl.float32)


@triton.jit
def _float16_bits(quad, i: tl.constexpr):
    """The ``i``-th bfloat16 activation of ``quad`` rounded to float16, as the low 16 bits of a 64-bit integer."""
    return _activation(quad, i, True).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF


@triton.jit
def _float16_quad(quad, BF16: tl.constexpr, ASM: tl.constexpr):
    """Four 16-bit activations (two pairs in 64 bits) as float16 (bfloat16 rounded; float16 as they are)."""
    if BF16 and ASM:
        out = tl.inline_asm_elementwise(_BF16_PAIRS_PTX, "=l,l", [quad], dtype=tl.int64, is_pure=True, pack=1)
    elif BF16:
        out = _float16_bits(quad, 0) | (_float16_bits(quad, 1) << 16)
        out = out | (_float16_bits(quad, 2) << 32) | (_float16_bits(quad, 3) << 48)
    else:
        out = quad
    return out


@triton.jit
def _normed_quad(quad, g_quad, inv_rms, BF16: tl.constexpr):
    """Four 16-bit activations (64 bits) RMS-normed as :func:`gpt_fast.model.transformer.rms_norm` rounds: each times
    ``inv_rms``, rounded to their dtype, times its norm weight (of ``g_quad``), rounded again; 64 bits of that
    dtype, so that what follows is the product of the norm's output."""
    kind: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    out = tl.zeros_like(quad)
    for i in tl.static_range(4):
        normed = (_activation(quad, i, BF16) * inv_rms).to(kind).to(tl.float32)
        value = (normed * _activation(g_quad, i, BF16)).to(kind)
        out = out | ((value.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF) << (16 * i))
    return out


@triton.jit
def _input_quads(x_quads, g_quads, mask, inv_rms, EVEN: tl.constexpr, BF16: tl.constexpr, NORM: tl.constexpr):
    """The 64-bit quads of activations at ``x_quads``, or with ``NORM`` of their RMSNorm (:func:`_normed_quad`,
    the norm's weights at ``g_quads``)."""
    quad = _load(x_quads, mask, EVEN)
    if NORM:
        quad = _normed_quad(quad, _load(g_quads, mask, EVEN), inv_rms, BF16)
    return quad


@triton.jit
def _scaled_pair(q_low, q_high, pair, SCALE: tl.constexpr):
    """``q_low / SCALE`` and ``q_high / SCALE`` times their float16 activation ``pair``, summed, in float16: the
    arithmetic of the float16-pairs PTX, for Triton's interpreter (which runs no PTX)."""
    low = _activation(pair, 0, False).to(tl.float16)
    high = _activation(pair, 1, False).to(tl.float16)
    return (q_low.to(tl.float16) / SCALE) * low + (q_high.to(tl.float16) / SCALE) * high


@triton.jit
def _pair_products(word, k: tl.constexpr, pair):
    """Nibbles ``k`` and ``k + 4`` of each 32-bit ``word`` as (q - 8) / 64 times their float16 activation
    ``pair``, summed, in float16 (:data:`_WORD_PAIR_PTX`'s arithmetic)."""
    return _scaled_pair(((word >> (4 * k)) & 0xF) - 8, ((word >> (4 * k + 16)) & 0xF) - 8, pair, HALF2_SCALE)


@triton.jit
def _word_dot(word, p0, p1, p2, p3):
    """``sum_k`` of :func:`_pair_products` over a word's four activation pairs, in float16."""
    return (_pair_products(word, 0, p0) + _pair_products(word, 1, p1)) + (
        _pair_products(word, 2, p2) + _pair_products(word, 3, p3)
    )


@triton.jit
def _eighths(quad, lane: tl.constexpr):
    """The sum, in float16, of an eighth of the float16 activations of ``quad`` (64 bits: two pairs) in ``lane``
    (0: each pair's low half, 1: its high half)."""
    return (_activation(quad, lane, False).to(tl.float16) * 0.125) + (
        _activation(quad, lane + 2, False).to(tl.float16) * 0.125
    )


@triton.jit
def _activation_sum(h0, h1, h2, h3, ASM: tl.constexpr):
    """The sum of the sixteen float16 activations of a word pair's quads ``h0``-``h3``, in float32
    (:data:`_EIGHTHS_SUM_PTX`; in Triton's interpreter the same float16 arithmetic)."""
    if ASM:
        total = tl.inline_asm_elementwise(
            _EIGHTHS_SUM_PTX, "=r,l,l,l,l", [h0, h1, h2, h3], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        low = (_eighths(h0, 0) + _eighths(h1, 0)) + (_eighths(h2, 0) + _eighths(h3, 0))
        high = (_eighths(h0, 1) + _eighths(h1, 1)) + (_eighths(h2, 1) + _eighths(h3, 1))
        total = 8.0 * (low.to(tl.float32) + high.to(tl.float32))
    return total


@triton.jit
def _half2_step(
    packed,
    x_quads,
    g_quads,
    inv_rms,
    col,
    K,
    scales,
    zeros,
    acc,
    HALF: tl.constexpr,
    EVEN: tl.constexpr,
    BF16: tl.constexpr,
    ASM: tl.constexpr,
    NORM: tl.constexpr,
):
    """One step of :func:`_int4_gemv` in float16 pairs: the word pairs ``packed`` [G, BLOCK_N, HALF] against the
    activations at ``x_quads`` [G, 1, HALF] (64 bits each: pair k of both words at ``+ k * HALF``, its first column
    ``col + 4 k HALF``), with ``NORM`` normed (:func:`_input_quads`); the new ``acc``."""
    q0 = _input_quads(x_quads, g_quads, col < K, inv_rms, EVEN, BF16, NORM)
    q1 = _input_quads(x_quads + HALF, g_quads + HALF, col + 4 * HALF < K, inv_rms, EVEN, BF16, NORM)
    q2 = _input_quads(x_quads + 2 * HALF, g_quads + 2 * HALF, col + 8 * HALF < K, inv_rms, EVEN, BF16, NORM)
    q3 = _input_quads(x_quads + 3 * HALF, g_quads + 3 * HALF, col + 12 * HALF < K, inv_rms, EVEN, BF16, NORM)
    h0 = _float16_quad(q0, BF16, ASM)
    h1 = _float16_quad(q1, BF16, ASM)
    h2 = _float16_quad(q2, BF16, ASM)
    h3 = _float16_quad(q3, BF16, ASM)
    x_sum = _activation_sum(h0, h1, h2, h3, ASM)
    scaled = scales * HALF2_SCALE
    if ASM:
        terms = [acc, packed, h0, h1, h2, h3, scaled, zeros, x_sum]
        acc = tl.inline_asm_elementwise(
            _WORD_PAIR_PTX, "=r,r,l,l,l,l,l,r,r,r", terms, dtype=tl.float32, is_pure=True, pack=1
        )
    else:  # Triton's interpreter runs no PTX: the same float16 arithmetic
        w0, w1 = _split(packed)
        a0, b0 = _split(h0)
        a1, b1 = _split(h1)
        a2, b2 = _split(h2)
        a3, b3 = _split(h3)
        dot = _word_dot(w0, a0, a1, a2, a3) + _word_dot(w1, b0, b1, b2, b3)
        acc += dot.to(tl.float32) * scaled + x_sum * zeros
    return acc


@triton.jit
def _word_terms_f32(word, x_cols, col, K, ONE, WORDS: tl.constexpr, EVEN: tl.constexpr):
    """float32 path: ``sum_n (1 + q_n / 128) x_n`` over the nibbles of each 32-bit ``word`` and the sum of the
    activations they meet (nibble ``n`` at ``x_cols + 2 (n % 4) WORDS + n // 4``)."""
    partial = tl.zeros(word.shape, dtype=tl.float32)
    x_sum = tl.zeros(col.shape, dtype=tl.float32)
    for n in tl.static_range(8):
        offset = 2 * (n % 4) * WORDS + n // 4
        x = _load(x_cols + offset, col + offset < K, EVEN).to(tl.float32)
        if 4 * n <= 16:
            moved = word << (16 - 4 * n)
        else:
            moved = word >> (4 * n - 16)
        partial += ((moved & 0x000F0000) | ONE).to(tl.float32, bitcast=True) * x
        x_sum += x
    return partial, x_sum


@triton.jit
def _float_step(packed, x_cols, col, K, ONE, scales, zeros, acc, WORDS: tl.constexpr, EVEN: tl.constexpr):
    """One step of :func:`_int4_gemv` in float32 over the word pairs ``packed`` (the first word's nibble 0 meets
    column ``col`` at ``x_cols``, the second's two columns on); the new ``acc``."""
    low, high = _split(packed)
    partial, x_sum = _word_terms_f32(low, x_cols, col, K, ONE, WORDS, EVEN)
    partial_high, x_sum_high = _word_terms_f32(high, x_cols + 2, col + 2, K, ONE, WORDS, EVEN)
    partial += partial_high
    x_sum += x_sum_high
    return acc + partial * (128.0 * scales) + (zeros - (128.0 + 8.0) * scales) * x_sum


@triton.jit
def _int4_step(
    packed,
    x_row,
    s_ptr,
    z_ptr,
    g_ptr,
    inv_rms,
    rows,
    g,
    re,
    N,
    K,
    NG,
    ONE,
    acc,
    GROUP: tl.constexpr,
    EVEN: tl.constexpr,
    HALF2: tl.constexpr,
    BF16: tl.constexpr,
    ASM: tl.constexpr,
    NORM: tl.constexpr,
):
    """One step of :func:`_int4_gemv` over the word pairs ``packed`` [G, BLOCK_N, HALF] of groups ``g`` [G, 1, 1]
    and channels ``rows`` [1, BLOCK_N, 1] (with ``NORM``, of the activations' RMSNorm, whose weights are at
    ``g_ptr``: float16 pairs only): the new ``acc``."""
    HALF: tl.constexpr = GROUP // 16  # word pairs per row and group
    at = rows * NG + g  # [G, BLOCK_N, 1]
    inside = (rows < N) & (g < NG)
    scales = _load(s_ptr + at, inside, EVEN).to(tl.float32)
    zeros = _load(z_ptr + at, inside, EVEN).to(tl.float32)
    col = g * GROUP + 4 * re  # [G, 1, HALF]: the column of each pair's first word's nibble 0
    if HALF2:
        quads = g * (GROUP // 4) + re
        x_quads = x_row.to(tl.pointer_type(tl.int64)) + quads
        g_quads = g_ptr.to(tl.pointer_type(tl.int64)) + quads
        acc = _half2_step(packed, x_quads, g_quads, inv_rms, col, K, scales, zeros, acc, HALF, EVEN, BF16, ASM, NORM)
    else:
        acc = _float_step(packed, x_row + col, col, K, ONE, scales, zeros, acc, 2 * HALF, EVEN)
    return acc


@triton.jit
def _int4_gemv(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    r_ptr,
    g_ptr,
    M,
    N,
    K,
    NG,
    ONE,
    eps,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN: tl.constexpr,
    HALF2: tl.constexpr,
    BF16: tl.constexpr,
    ASM: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
    ROW_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """int4 weights in the words of :func:`gpt_fast.quant.products.group_interleave`, read two at a time as 64-bit
    elements: word ``j`` of a group holds in nibbles ``k`` and ``k + 4`` its columns ``2 (k WORDS + j)`` and the
    one after, so that each pair of nibbles meets one 32-bit pair of 16-bit activations, and the pairs that a
    nibble position of consecutive words meets are contiguous (vector loads). With ``w = (q - 8) s + zero`` per
    group, a word's sum is ``s * sum((q - 8) x) + zero * sum(x)``. A step's tile is [GROUPS, BLOCK_N, word pairs]:
    the activations, loaded [GROUPS, 1, word pairs], are converted once for all the rows a thread holds; the
    partial sums, one per word pair, are reduced once at the end.

    ``HALF2`` (16-bit activations): products summed in float16 pairs, two words at a time
    (:data:`_WORD_PAIR_PTX`), about half the instructions per weight of float32, at float16's precision over 16
    terms before the float32 sum. Otherwise float32: a nibble becomes the float ``1 + q / 128`` by moving it to
    bits 16-19 and setting the exponent bits of 1.0 (``ONE``, an argument: held in a register, the mask and the
    exponent bits take one logical instruction, where two constants take two); the sum is then ``128 s * sum(v x)
    + (zero - 136 s) * sum(x)``.

    A decode step's row can come with its neighbours inside (``HALF2`` only): the RMSNorm before the product
    (``NORM``, weights ``g``, epsilon ``eps``; :func:`_input_quads`), the residual added after it (``RESIDUAL``,
    ``r``) or a gated MLP's activation after ``w13`` (``GATED``; :func:`_store_rows`), so that none is a kernel of
    its own.

    The first step's words are loaded before the wait for the activations (``PDL``, :mod:`gpt_fast.kernels.pdl`)."""
    m, rn = _program_rows(M, N, BLOCK_N, GATED)
    HALF: tl.constexpr = GROUP // 16  # word pairs per row and group
    rg = tl.arange(0, GROUPS)[:, None, None]
    rows = rn[None, :, None]
    re = tl.arange(0, HALF)[None, None, :]
    w_tile = w_ptr.to(tl.pointer_type(tl.int64)) + rows.to(tl.int64) * (NG * HALF) + rg * HALF + re
    x_row = x_ptr + m * K
    acc = tl.zeros((GROUPS, BLOCK_N, HALF), dtype=tl.float32)
    packed = _load(w_tile, (rg < NG) & (rows < N), EVEN)  # [GROUPS, BLOCK_N, HALF]
    wait_for_inputs(PDL)
    inv_rms = inverse_rms(x_row, K, eps, ROW_K, NORM)
    acc = _int4_step(
        packed,
        x_row,
        s_ptr,
        z_ptr,
        g_ptr,
        inv_rms,
        rows,
        rg,
        re,
        N,
        K,
        NG,
        ONE,
        acc,
        GROUP,
        EVEN,
        HALF2,
        BF16,
        ASM,
        NORM,
    )
    for g0 in range(GROUPS, NG, GROUPS):
        g = g0 + rg
        packed = _load(w_tile + g0 * HALF, (g < NG) & (rows < N), EVEN)
        acc = _int4_step(
            packed,
            x_row,
            s_ptr,
            z_ptr,
            g_ptr,
            inv_rms,
            rows,
            g,
            re,
            N,
            K,
            NG,
            ONE,
            acc,
            GROUP,
            EVEN,
            HALF2,
            BF16,
            ASM,
            NORM,
        )
    y = tl.sum(tl.sum(acc, axis=2), axis=0)
    _store_rows(y_ptr, r_ptr, m, N, rn, y, RESIDUAL, GATED, GELU, BLOCK_N)


# One 64-bit element of int8_interleave ($2: two words of four bytes q + 128) against its activations as float16
# pairs ($3: the first word's two pairs, $4: the second's), summed in float16 pairs; the sum ends as one float32
# added to the accumulator ($1). Per word: two byte permutes (two bytes and 0x64 each: the float16 pair 1024 + q +
# 128, exact), two packed multiply-adds to exactly q / 256, two with the activations. Each half of the pair sums
# four products of at most |x| / 2: below 65504 up to |x| = 32752, as int4's.
_BYTE_PAIRS_PTX = ptx_block(
    ".reg .b32 w0, w1, a0, a1, b0, b1, t0, t1, t2, t3, magic, scale, offset, h;",
    ".reg .b16 lo, hi;",
    ".reg .f32 flo, fhi;",
    "mov.b64 {w0, w1}, $2;",
    "mov.b64 {a0, a1}, $3;",
    "mov.b64 {b0, b1}, $4;",
    "mov.b32 magic, 0x64646464;",
    "mov.b32 scale, 0x1C001C00;",
    "mov.b32 offset, 0xC480C480;",
    "prmt.b32 t0, w0, magic, 0x4140;",
    "prmt.b32 t1, w0, magic, 0x4342;",
    "prmt.b32 t2, w1, magic, 0x4140;",
    "prmt.b32 t3, w1, magic, 0x4342;",
    "fma.rn.f16x2 t0, t0, scale, offset;",
    "fma.rn.f16x2 t1, t1, scale, offset;",
    "fma.rn.f16x2 t2, t2, scale, offset;",
    "fma.rn.f16x2 t3, t3, scale, offset;",
    "mul.rn.f16x2 h, t0, a0;",
    "fma.rn.f16x2 h, t1, a1, h;",
    "fma.rn.f16x2 h, t2, b0, h;",
    "fma.rn.f16x2 h, t3, b1, h;",
    *_PAIR_TO_FLOAT32,
    "add.f32 flo, flo, fhi;",
    "add.f32 $0, $1, flo;",
)
INT8_SCALE = tl.constexpr(256.0)  # the words' products are (q / 256) x


@triton.jit
def _byte_products(word, j: tl.constexpr, pair):
    """Bytes ``2 j`` and ``2 j + 1`` (``q + 128``) of each 32-bit ``word`` as q / 256 times their float16
    activation ``pair``, summed, in float16 (:data:`_BYTE_PAIRS_PTX`'s arithmetic)."""
    return _scaled_pair(((word >> (16 * j)) & 0xFF) - 128, ((word >> (16 * j + 8)) & 0xFF) - 128, pair, INT8_SCALE)


@triton.jit
def _interleaved_step(
    packed,
    x_row,
    g_ptr,
    inv_rms,
    b,
    re,
    NB,
    acc,
    EVEN: tl.constexpr,
    BF16: tl.constexpr,
    ASM: tl.constexpr,
    NORM: tl.constexpr,
):
    """One step of :func:`_int8_interleaved_gemv` over the elements ``packed`` [B, BLOCK_N, 8] of blocks ``b`` [B,
    1, 1] (with ``NORM``, of the activations' RMSNorm, whose weights are at ``g_ptr``): the new ``acc`` (sums of
    ``(q / 256) x``)."""
    quads = b * 16 + re  # [B, 1, 8]: each element's first word's quad
    x_quads = x_row.to(tl.pointer_type(tl.int64)) + quads
    g_quads = g_ptr.to(tl.pointer_type(tl.int64)) + quads
    low = _float16_quad(_input_quads(x_quads, g_quads, b < NB, inv_rms, EVEN, BF16, NORM), BF16, ASM)
    high = _float16_quad(_input_quads(x_quads + 8, g_quads + 8, b < NB, inv_rms, EVEN, BF16, NORM), BF16, ASM)
    if ASM:
        acc = tl.inline_asm_elementwise(
            _BYTE_PAIRS_PTX, "=r,r,l,l,l", [acc, packed, low, high], dtype=tl.float32, is_pure=True, pack=1
        )
    else:  # Triton's interpreter runs no PTX: the same float16 arithmetic
        w0, w1 = _split(packed)
        a0, a1 = _split(low)
        b0, b1 = _split(high)
        dot = (_byte_products(w0, 0, a0) + _byte_products(w0, 1, a1)) + (
            _byte_products(w1, 0, b0) + _byte_products(w1, 1, b1)
        )
        acc += dot.to(tl.float32)
    return acc


@triton.jit
def _int8_interleaved_gemv(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    r_ptr,
    g_ptr,
    M,
    N,
    K,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
    EVEN: tl.constexpr,
    BF16: tl.constexpr,
    ASM: tl.constexpr,
    NORM: tl.constexpr,
    RESIDUAL: tl.constexpr,
    GATED: tl.constexpr,
    GELU: tl.constexpr,
    ROW_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """16-bit activations against int8 weights in the words of :func:`gpt_fast.quant.products.int8_interleave`,
    read two at a time as 64-bit elements: element ``e`` of a block of 64 columns holds the block's columns ``4 e``
    to ``4 e + 3`` in its first word and ``32 + 4 e`` to ``32 + 4 e + 3`` in its second, each byte ``q + 128``.
    A step's tile is [BLOCKS, BLOCK_N, 8 elements], as int4's [groups, rows, word pairs]: the activations, loaded
    [BLOCKS, 1, 8] as 64-bit quads, are converted to float16 once for all the rows a thread holds; the products
    are summed in float16 pairs (:data:`_BYTE_PAIRS_PTX`), one partial sum per element, reduced once at the end and
    scaled by the row's scale. A decode step's norm, residual add or gated activation comes inside as in
    :func:`_int4_gemv`.

    The first step's words are loaded before the wait for the activations (``PDL``, :mod:`gpt_fast.kernels.pdl`)."""
    m, rn = _program_rows(M, N, BLOCK_N, GATED)
    NB = K // 64
    rb = tl.arange(0, BLOCKS)[:, None, None]
    rows = rn[None, :, None]
    re = tl.arange(0, 8)[None, None, :]
    w_tile = w_ptr.to(tl.pointer_type(tl.int64)) + rows.to(tl.int64) * (NB * 8) + rb * 8 + re
    x_row = x_ptr + m * K
    acc = tl.zeros((BLOCKS, BLOCK_N, 8), dtype=tl.float32)
    packed = _load(w_tile, (rb < NB) & (rows < N), EVEN)  # [BLOCKS, BLOCK_N, 8]
    wait_for_inputs(PDL)
    inv_rms = inverse_rms(x_row, K, eps, ROW_K, NORM)
    acc = _interleaved_step(packed, x_row, g_ptr, inv_rms, rb, re, NB, acc, EVEN, BF16, ASM, NORM)
    for b0 in range(BLOCKS, NB, BLOCKS):
        b = b0 + rb
        packed = _load(w_tile + b0 * 8, (b < NB) & (rows < N), EVEN)
        acc = _interleaved_step(packed, x_row, g_ptr, inv_rms, b, re, NB, acc, EVEN, BF16, ASM, NORM)
    y = tl.sum(acc, axis=0) * INT8_SCALE
    _store_int8(y_ptr, s_ptr, r_ptr, m, N, rn, y, RESIDUAL, GATED, GELU, BLOCK_N)


ONE_SIGN_BITS = 0x3FC00000  # the float 1.0 and the sign bit of a byte at bits 15-22 (see _int8_gemv)


def int8_launch(n: int, k: int, interleaved: bool = False, inside: Inside = NOTHING_INSIDE) -> Launch:
    """The tile for an [n, k] int8 matrix:

    - as it is: 8 rows of up to 2048 columns per program (read as int32 words), 4 warps; the best single tile of
      ``scripts/quant_gemv.py --sweep`` on an H200 (docs/bench/HISTORY.md, 2026-11-22d, its raw sweep): 70.4 us for a
      Llama-2-7B layer's four GEMVs against 94.2 us for 2 rows of 1024 columns, and within 10 % of each matrix's own
      best tile;
    - ``interleaved`` (:func:`gpt_fast.quant.products.int8_interleave`, 16-bit activations): 4 rows of 2048 columns per
      step, 4 warps (each thread reading 16 bytes of each row per step), the best single tile of the sweep in
      docs/bench/HISTORY.md, 2026-11-24g: in one run, 62.5 us for a Llama-2-7B layer against 64.7 for the matrix as it
      is, 57.2 against 60.4 for Llama-3-8B's three largest; within 8 % of each matrix's own best tile but for the 7B
      ``w2`` (17.1 us in the sweep, against 14.7 with 4096 columns per step);
    - interleaved with a norm ``inside``: each program normalizes its activations itself, so more rows share that work:
      8 rows, or 16 for a gated MLP's ``w13`` (half of them gate rows). On an H200 (docs/bench/HISTORY.md, 2026-11-25c),
      Llama-2-7B ``wqkv`` with the norm 15.4 us against 17.4 with 4 rows (14.1 without the norm), ``w13`` with the norm
      and the activation 26.0 against 29.9 (23.3 without either)."""
    if interleaved and inside.norm_weight is not None:
        return Launch(16 if inside.activation else 8, 2048, 4)
    if interleaved:
        return Launch(4, 2048, 4)
    return Launch(8, min(2048, triton.next_power_of_2(k)), 4, words=True)


def outputs(rows: int, activation: str | None) -> int:
    """The outputs of a product over ``rows`` weight rows: a gated MLP's ``w13`` (``activation``) gives half."""
    return rows if activation is None else rows // 2


def _prelude(
    x: torch.Tensor, n: int, launch: Launch, activation: str | None = None
) -> tuple[torch.Tensor, tuple[int], bool, bool]:
    """What both GEMVs set up for ``x`` [M, K] and ``n`` weight rows: the output [M, :func:`outputs`], the grid
    (one program per row and block of weight rows), whether the blocks tile K and N exactly, and whether int8
    weights are read as int32 words."""
    m, k = x.shape
    y = torch.empty((m, outputs(n, activation)), dtype=x.dtype, device=x.device)
    even = k % launch.block_k == 0 and n % launch.block_n == 0
    grid = (m * triton.cdiv(n, launch.block_n),)
    return y, grid, even, launch.words and k % 8 == 0


def int8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    launch: Launch | None = None,
    wrap: Wrap = unwrapped,
    pdl: bool = False,
    inside: Inside = NOTHING_INSIDE,
) -> torch.Tensor:
    """``x`` [M, K] @ (int8 matrix × ``scales`` [N]).T -> [M, N] in ``x``'s dtype, ``weight`` the matrix [N, K]
    (int8), or for 16-bit ``x`` its words [N, K / 4] (int32, from :func:`gpt_fast.quant.products.int8_interleave`);
    ``pdl``: launched with programmatic dependent launch where the GPU has it; ``inside`` (words only): what else
    the kernel computes (a gated one returns [M, N / 2])."""
    m, k = x.shape
    n = weight.shape[0]
    interleaved = weight.dtype == torch.int32
    assert not interleaved or x.dtype != torch.float32, "interleaved int8 words take 16-bit activations"
    assert interleaved or inside.empty(), "only the interleaved words' kernel computes more inside"
    launch = launch or int8_launch(n, k, interleaved, inside)
    y, grid, even, words = _prelude(x, n, launch, inside.activation)
    common = {"BLOCK_N": launch.block_n, "EVEN": even, **launch.compile_options(), **pdl_launch(x.device, pdl)}
    if interleaved:
        wrap(_int8_interleaved_gemv)[grid](
            x,
            weight,
            scales,
            y,
            M=m,
            N=n,
            K=k,
            BLOCKS=launch.block_k // 64,
            BF16=x.dtype == torch.bfloat16,
            ASM=x.is_cuda,
            **inside.arguments(x, y),
            **common,
        )
    else:
        wrap(_int8_gemv)[grid](
            x,
            weight.view(torch.int32) if words else weight,
            scales,
            y,
            m,
            n,
            k,
            ONE_SIGN_BITS,
            BLOCK_K=launch.block_k,
            AS_WORDS=words,
            **common,
        )
    return y


ONE_BITS = 0x3F800000  # the float 1.0 (see _int4_gemv)
WIDE_ROWS = 8192  # int4 matrices of at least this many rows take 2 warps per program, narrower ones 4 (int4_launch)
STEP_COLUMNS_PER_WARP = 1024  # int4: each warp's share of a step's columns (int4_launch)


def int4_launch(n: int, group_size: int, half2: bool = True) -> Launch:
    """The tile for an int4 matrix of n rows, from ``scripts/quant_gemv.py --sweep`` on an H200 with groups of 128
    (docs/bench/HISTORY.md, 2026-11-24f):

    - ``half2`` (16-bit activations): 8 rows per program; 2 warps for a matrix of at least :data:`WIDE_ROWS` rows,
      else 4 (more programs' worth of warps for a narrow one); 1024 columns per step for each warp, so that a
      step's activations fill every thread as the weights do and both keep one layout. 43.4 us for a Llama-2-7B
      layer's four matrices, against 57.1 for a kernel that converts activations loaded in a layout of their own to
      the tile's;
    - float32 activations: 8 rows, 1024 columns per step, one warp (103 us for the same layer, against 69.7 with a
      weight interleave made for them: the activations, read one column at a time, do not keep the weights' layout,
      which serves the 16-bit path)."""
    if not half2:
        return Launch(8, STEP_COLUMNS_PER_WARP, 1)
    warps = 2 if n >= WIDE_ROWS else 4
    return Launch(8, STEP_COLUMNS_PER_WARP * warps, warps, half2=True)


def int4_gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    launch: Launch | None = None,
    wrap: Wrap = unwrapped,
    pdl: bool = False,
    inside: Inside = NOTHING_INSIDE,
) -> torch.Tensor:
    """``x`` [M, K] @ dequantized(``words`` [N, G * group_size / 8] int32, ``scales``/``zeros`` [N, G]).T ->
    [M, N]; ``words`` from :func:`gpt_fast.quant.products.group_interleave`; ``pdl`` and ``inside`` (float16 pairs
    only) as for :func:`int8_gemv`."""
    m, k = x.shape
    n, n_groups = scales.shape
    half2 = x.dtype != torch.float32 and k % 4 == 0  # 16-bit activations, read four at a time: float16 pairs
    launch = launch or int4_launch(n, group_size, half2)
    assert (launch.half2 and half2) or inside.empty(), "only float16 pairs compute more inside"
    y, grid, even, _ = _prelude(x, n, launch, inside.activation)
    wrap(_int4_gemv)[grid](
        x,
        words,
        scales,
        zeros,
        y,
        M=m,
        N=n,
        K=k,
        NG=n_groups,
        ONE=ONE_BITS,
        BLOCK_N=launch.block_n,
        GROUPS=launch.block_k // group_size,
        GROUP=group_size,
        EVEN=even,
        HALF2=launch.half2 and half2,
        BF16=x.dtype == torch.bfloat16,
        ASM=x.is_cuda,
        **inside.arguments(x, y),
        **launch.compile_options(),
        **pdl_launch(x.device, pdl),
    )
    return y
