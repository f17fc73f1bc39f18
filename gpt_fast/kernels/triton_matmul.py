"""A Triton matrix product for a prompt's rows (more than a decode step's few) times quantized weights as our
decode kernels keep them: int8 in the words of :func:`gpt_fast.quant.products.int8_interleave`, int4 in those of
:func:`gpt_fast.quant.products.group_interleave`. Each program dequantizes a tile of words in registers and
multiplies it on the tensor cores (``tl.dot``), so a prefill reads the packed weights once. The alternative, a
16-bit copy of each matrix per call then ``F.linear``, writes and reads two bytes per weight besides; in eager
PyTorch (a graphed prefill is eager) the int4 copy takes six passes over each matrix (docs/bench/HISTORY.md,
2026-11-25d).

The activations' columns come in the words' order (:func:`gpt_fast.quant.products.int8_columns`,
:func:`gpt_fast.quant.products.group_columns`: a few kilobytes per row), so that the ``VALUES`` values of a word,
lowest bits first, meet ``VALUES`` consecutive columns, and a tile of words unpacks to a tile of weights whose
columns are contiguous columns of the activations. The weights are rounded as the PyTorch dequantization rounds
them (int4: the scale's product, then the zero's sum, each to the activations' dtype; int8: the levels are exact),
the products are summed in float32, and an int8 product is scaled after its rounding, as
``F.linear(x, w) * scales``.

A batched decode step's 6 to 64 int4 rows take :func:`int4_rows` instead: the words are the tensor cores' first
operand and the rows (padded to 16, 32 or 64) the second, the activations in their own column order, each nibble
pair widened to a bfloat16 pair in PTX on NVIDIA GPUs (:data:`PAIR_WIDENING`), and splits along the columns summed
in a fixed order (docs/quantization.md, "int4 batched steps").

Imported only where Triton is (:mod:`gpt_fast.quant.products` decides); the launchers run on CUDA tensors, and in
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpt_fast.kernels.pdl import Wrap, unwrapped
from gpt_fast.kernels.triton_gemv import ptx_block


@dataclass(frozen=True)
class Tile:
    """A program's output tile (activation rows by weight rows) and weight columns per step, and its launch."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


@triton.jit
def _dequantized(centered, scales, zeros, dtype: tl.constexpr):
    """``centered`` int4 levels (``q - 8``, float32) as weights in ``dtype``: ``(q - 8) s + zero`` with float32
    ``scales`` and ``zeros``, the product and then the sum rounded to ``dtype``, as PyTorch's dequantization in that
    dtype rounds them."""
    return ((centered * scales).to(dtype).to(tl.float32) + zeros).to(dtype)


@triton.jit
def _weights(words, s_ptr, z_ptr, rn, k0, NG, N, VALUES: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The words [BLOCK_N, BLOCK_K / VALUES] from column ``k0`` as weights [BLOCK_N, BLOCK_K] in the scales' dtype:
    int8 bytes as ``q = byte - 128`` (exact); int4 nibbles as ``(q - 8) s + zero`` with their group's scale and
    zero (``GROUP`` > 0)."""
    BITS: tl.constexpr = 32 // VALUES
    shifts = tl.arange(0, VALUES) * BITS
    levels = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)  # [BLOCK_N, words, VALUES]
    if GROUP == 0:
        weights = (levels - 128).to(s_ptr.dtype.element_ty)
    else:
        GROUPS: tl.constexpr = BLOCK_K // GROUP
        rg = k0 // GROUP + tl.arange(0, GROUPS)
        at = rn[:, None] * NG + rg[None, :]  # [BLOCK_N, GROUPS]
        mask = (rn[:, None] < N) & (rg[None, :] < NG)
        scales = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32)[:, :, None]  # [BLOCK_N, GROUPS, 1]
        zeros = tl.load(z_ptr + at, mask=mask, other=0.0).to(tl.float32)[:, :, None]
        grouped = tl.reshape((levels - 8).to(tl.float32), (words.shape[0], GROUPS, GROUP))
        weights = _dequantized(grouped, scales, zeros, s_ptr.dtype.element_ty)
    return tl.reshape(weights, (words.shape[0], BLOCK_K))


@triton.jit
def _words_matmul(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    NG,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VALUES: tl.constexpr,
    GROUP: tl.constexpr,
):
    """``y`` [M, N] = ``x`` [M, K] (columns in the words' order) times the weights of ``w`` [N, K / VALUES]
    transposed. Programs are numbered row-block-fastest: the programs that read one block of weights run side by
    side, and all but the first find it in L2."""
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    rm = (pid % blocks_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid // blocks_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    WORDS: tl.constexpr = BLOCK_K // VALUES
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, WORDS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x_mask = (rm[:, None] < M) & (k0 + rk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + k0 + rk[None, :], mask=x_mask, other=0.0)
        w_at = w_ptr + rn[:, None].to(tl.int64) * (K // VALUES) + k0 // VALUES + rw[None, :]
        words = tl.load(w_at, mask=(rn[:, None] < N) & (k0 // VALUES + rw[None, :] < K // VALUES), other=0)
        weights = _weights(words, s_ptr, z_ptr, rn, k0, NG, N, VALUES, GROUP, BLOCK_K)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(weights), acc)
    out = acc.to(y_ptr.dtype.element_ty)
    if GROUP == 0:
        scales = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) * scales[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], out, mask=(rm[:, None] < M) & (rn[None, :] < N))


# Two int4 levels as a pair of bfloat16 weights in one 32-bit register (PTX): the word's nibbles at bits 0-3 and
# 16-19 go into the low mantissa bits of 128.0 (0x4300), which makes them 128 + q exactly; one fused multiply-add
# per step then takes 136 off (q - 8, exact), multiplies by the scale and adds the zero, each rounded to bfloat16 as
# PyTorch's dequantization rounds them (``fma.rn`` with -0.0 or 1.0 is a product or a sum rounded once).
PAIR_WIDENING = ptx_block(
    ".reg .b32 t, c, one, nz;",
    "mov.b32 c, 0xC308C308;",  # -136.0, twice
    "mov.b32 one, 0x3F803F80;",
    "mov.b32 nz, 0x80008000;",  # -0.0
    "lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xea;",  # (a & b) | c
    "fma.rn.bf16x2 t, t, one, c;",
    "fma.rn.bf16x2 t, t, $3, nz;",
    "fma.rn.bf16x2 t, t, one, $4;",
    "mov.b32 {$0, $1}, t;",
)


@triton.jit
def _pair_weights(shifted, scales, zeros, PTX: tl.constexpr):
    """The weights of the nibbles at bits 0-3 and 16-19 of ``shifted`` (words [BLOCK_N, WORDS] shifted right by
    4 k) with their group's ``scales`` and ``zeros`` (as the words), in the scales' dtype: ``(q - 8) s + zero``,
    each step rounded to it. ``PTX``: two at a time in bfloat16 pairs (:data:`PAIR_WIDENING`)."""
    if PTX:
        s16 = scales.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        z16 = zeros.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        return tl.inline_asm_elementwise(
            PAIR_WIDENING,
            "=h,=h,r,r,r",
            [shifted, s16 | (s16 << 16), z16 | (z16 << 16)],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=1,
        )
    s, z = scales.to(tl.float32), zeros.to(tl.float32)
    low = _dequantized(((shifted & 15) - 8).to(tl.float32), s, z, scales.dtype)
    high = _dequantized((((shifted >> 16) & 15) - 8).to(tl.float32), s, z, scales.dtype)
    return low, high


@triton.jit
def _int4_rows(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    KW,
    NG,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    SPLITS: tl.constexpr,
    STAGES: tl.constexpr,
    PTX: tl.constexpr,
):
    """``y`` = ``x`` [M, K] (columns in their own order) times the int4 words ``w`` [N, KW] transposed, with the
    weights as the products' first operand: a program's [BLOCK_N, ROWS] sums for ``BLOCK_N`` weight rows, ``x``'s
    rows padded to ``ROWS`` (16 at least, the tensor cores' narrowest). Split ``s`` of ``SPLITS`` takes every
    ``SPLITS``-th step of ``WORDS`` words; with more than one, ``y`` is [SPLITS, M, N] float32 sums."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, ROWS)
    rw = tl.arange(0, WORDS)
    GW: tl.constexpr = GROUP // 8  # words per group
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for w0 in tl.range(split * WORDS, KW, SPLITS * WORDS, num_stages=STAGES):
        wi = w0 + rw  # [WORDS]
        ok = n_ok[:, None] & (wi < KW)[None, :]
        words = tl.load(w_ptr + rn[:, None].to(tl.int64) * KW + wi[None, :], mask=ok, other=0)
        at = rn[:, None] * NG + (wi // GW)[None, :]
        scales = tl.load(s_ptr + at, mask=ok, other=0.0)
        zeros = tl.load(z_ptr + at, mask=ok, other=0.0)
        for k in tl.static_range(4):  # nibbles k and k + 4: columns c and c + 1 (group_interleave)
            low, high = _pair_weights(words >> (4 * k), scales, zeros, PTX)  # [BLOCK_N, WORDS] each
            col = (wi // GW) * GROUP + 2 * (k * GW + wi % GW)  # [WORDS]
            x_at = x_ptr + rm[None, :] * K + col[:, None]
            x_ok = m_ok[None, :] & (col < K)[:, None]
            acc = tl.dot(low, tl.load(x_at, mask=x_ok, other=0.0), acc)
            acc = tl.dot(high, tl.load(x_at + 1, mask=x_ok & (col + 1 < K)[:, None], other=0.0), acc)
    out = y_ptr + rm[None, :] * N + rn[:, None]
    if SPLITS == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])
    else:
        tl.store(out + split * M * N, acc, mask=m_ok[None, :] & n_ok[:, None])


WIDE_ROWS = 8192  # int4 weight matrices of at least this many rows take wider tiles for few activation rows


def tile_for(rows: int, n: int, group_size: int) -> Tile:
    """The tile for ``rows`` activation rows, ``n`` weight rows and int4 groups of ``group_size`` (0: int8), from a
    sweep on an H200 over Llama-2-7B's matrices in bfloat16 (docs/bench/HISTORY.md, 2026-11-25d): up to 64 rows, a block
    of 16, 32 or 64 rows and narrow blocks of weights, for enough programs to stream the weights (int4: 256 columns per
    step, 8 warps, 128 weight rows for a wide matrix); more rows, blocks of 128 rows, 128 columns and 8 warps, 64 weight
    rows up to 256 activation rows, then 128."""
    block_m = min(max(16, triton.next_power_of_2(rows)), 128)
    if rows > 64:  # groups of 256 take their whole group per step: two stages of it fit in shared memory
        return Tile(block_m, 64 if rows <= 256 else 128, max(128, group_size), 8, 3 if group_size <= 128 else 2)
    if group_size:
        return Tile(block_m, 128 if n >= WIDE_ROWS and rows > 16 else 32, max(256, group_size), 8, 3)
    return Tile(block_m, 32, 128, 4, 3)


def words_matmul(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    tile: Tile | None = None,
    wrap: Wrap = unwrapped,
) -> torch.Tensor:
    """``x`` [M, K] (columns in the words' order) times the weights of ``words`` [N, K / values] transposed ->
    [M, N] in ``x``'s dtype: int8 (``group_size`` 0, ``zeros`` None: per-channel ``scales`` [N]) or int4
    (``scales`` and ``zeros`` [N, groups])."""
    m, k = x.shape
    n = words.shape[0]
    values = 8 if group_size else 4
    assert k == words.shape[1] * values and x.dtype == scales.dtype and (zeros is None) == (group_size == 0)
    tile = tile or tile_for(m, n, group_size)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n),)
    wrap(_words_matmul)[grid](
        x.contiguous(),
        words,
        scales,
        scales if zeros is None else zeros,
        y,
        M=m,
        N=n,
        K=k,
        NG=scales.shape[-1] if group_size else 1,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        VALUES=values,
        GROUP=group_size,
        num_warps=tile.warps,
        num_stages=tile.stages,
    )
    return y


ROWS_BLOCK_N = 128  # int4_rows: weight rows per program
ROWS_PROGRAMS = 320  # int4_rows: programs that its splits along the columns aim at


@dataclass(frozen=True)
class RowsTile:
    """:func:`int4_rows`' launch: weight rows and words (8 columns each) per program step, programs along the
    columns (their float32 sums added in a fixed order after), warps and pipeline stages."""

    block_n: int
    words: int
    splits: int
    warps: int
    stages: int


def rows_tile_for(rows: int, n: int) -> RowsTile:
    """The tile of :func:`int4_rows` for ``rows`` activation rows and ``n`` weight rows: 128 weight rows per
    program, 32 words a step up to 16 rows and 16 beyond (the sums of 32 or 64 rows take the registers), and the
    power of two of splits along the columns (8 at most) that makes the programs nearest :data:`ROWS_PROGRAMS`. On an
    H200, Llama-2-7B's four matrices at 12 to 64 rows, this rule's tiles take 761 µs in all against 743 for the best
    of 24 tiles each (BENCHMARKS.md, 2026-12-02e)."""
    blocks = triton.cdiv(n, ROWS_BLOCK_N)
    splits = min(8, 1 << max(0, round(math.log2(ROWS_PROGRAMS / blocks))))
    return RowsTile(ROWS_BLOCK_N, 32 if rows <= 16 else 16, splits, 4, 3)


def pair_widening(x: torch.Tensor) -> bool:
    """Whether :func:`int4_rows` widens its levels by :data:`PAIR_WIDENING`'s PTX: bfloat16 activations on a GPU
    of compute capability 8.0 or more (``fma.rn.bf16x2``; our Triton kernels run on NVIDIA GPUs only,
    :func:`gpt_fast.kernels.available.triton_usable`); else (float16, Triton's interpreter) in Triton."""
    return x.dtype == torch.bfloat16 and x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 0)


def int4_rows(
    x: torch.Tensor,
    words: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    tile: RowsTile | None = None,
    wrap: Wrap = unwrapped,
) -> torch.Tensor:
    """``x`` [M, K] (a batched decode step's rows, columns in their own order) times the int4 weights of ``words``
    [N, groups * group_size / 8] (:func:`gpt_fast.quant.products.group_interleave`) transposed -> [M, N] in
    ``x``'s dtype, with ``scales`` and ``zeros`` [N, groups]."""
    m, k = x.shape
    n, kw = words.shape
    assert x.dtype == scales.dtype == zeros.dtype and kw * 8 >= k
    tile = tile or rows_tile_for(m, n)
    shape = (m, n) if tile.splits == 1 else (tile.splits, m, n)
    y = torch.empty(shape, dtype=x.dtype if tile.splits == 1 else torch.float32, device=x.device)
    wrap(_int4_rows)[(triton.cdiv(n, tile.block_n), tile.splits)](
        x.contiguous(),
        words,
        scales,
        zeros,
        y,
        M=m,
        N=n,
        K=k,
        KW=kw,
        NG=scales.shape[-1],
        BLOCK_N=tile.block_n,
        WORDS=tile.words,
        GROUP=group_size,
        ROWS=max(16, triton.next_power_of_2(m)),
        SPLITS=tile.splits,
        STAGES=tile.stages,
        PTX=pair_widening(x),
        num_warps=tile.warps,
    )
    return y if tile.splits == 1 else y.sum(0).to(x.dtype)
