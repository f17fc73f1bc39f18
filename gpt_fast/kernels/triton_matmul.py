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

Imported only where Triton is (:mod:`gpt_fast.quant.products` decides); the launchers run on CUDA tensors, and in
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpt_fast.kernels.pdl import Wrap, unwrapped


@dataclass(frozen=True)
class Tile:
    """A program's output tile (activation rows by weight rows) and weight columns per step, and its launch."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


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
        scaled = (grouped * scales).to(s_ptr.dtype.element_ty).to(tl.float32)
        weights = (scaled + zeros).to(s_ptr.dtype.element_ty)
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
