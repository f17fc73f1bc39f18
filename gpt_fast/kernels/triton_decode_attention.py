"""Triton kernels for the attention of one decode step: a single query position per row, over the KV cache.

One program per (row, kv head, split of the cache's positions) does what inductor makes six kernels of: the rotary
embedding of the step's queries and key, the write of the new key and value into the cache, the scores against
the cached keys, the softmax and the weighted sum of the values. The query heads that share a kv head (GQA) are one
program's rows, so that each key and value is read once. Only the positions the query sees are read (up to its own,
and not older than a sliding window), where the PyTorch path reads the whole cache under an additive mask.

Long caches are split over programs (flash-decoding): each split keeps a running maximum, sum and weighted sum of
values, and a second small kernel combines the splits, in one order whatever the cache's length (so a token's result
does not depend on it). With one split the first kernel writes the output itself. A row has at most
:data:`SPLIT_PROGRAMS` programs over its kv heads (:func:`max_splits`): a query that sees more positions than they
cover in the launch's split length takes splits of a multiple of it, and the combination of many splits reads only
those that cover the query's positions. A query early in a long cache (a server's, sized for the model's context)
is then neither spread over hundreds of idle programs nor combined from hundreds of empty splits.

The step's own key is not read back from the cache: every program rotates it in registers and the program whose
split holds its position also writes it (and the value) to the cache, so no program reads a position written in
the same launch. It is rounded to the cache's dtype first, as a later step reads it.

The cache's dtype may be the model's or another: keys and values are widened to float32 as they are loaded. A float8
cache (``--kv_cache_dtype float8_e4m3fn``) reads half a 16-bit one's bytes; its values are exact in the tensor
cores' float16 products, which its tiles take (:func:`decode_launch`), as 16-bit ones are in TF32's.

The cache is static (:class:`gpt_fast.model.cache.KVCache`, a row of positions per sequence) or paged
(:class:`gpt_fast.model.cache.PagedKVCache`): blocks of positions shared by all rows, each row's named by its row of
the block table. The decode kernel reads both, the same code but for where a position's key is (:func:`_offsets`):
a paged row's keys are found through its table, and read up to its own position only, so that its cost follows its
own length, not the cache's. The batch-invariant kernels read static caches only.

Batch-invariant steps (:func:`rows_attention`, ``--batch_invariant``) take any number of query positions per row:
a first kernel rotates and writes every new key and value into a static cache, then each (query position, kv head,
split) program attends over the cache up to its own position, its own key included. A query's program then does the
same work, in the same order, with the same compiled code, whether it is a decode step's only position or one of a
verify step's k + 1: its result does not depend on the others.

Rounding follows the PyTorch path (:func:`gpt_fast.model.transformer.apply_rope`,
:func:`gpt_fast.model.transformer.attend_one_query`):
the rotation in float32, rounded to the model's dtype, then scores, softmax and sums in float32.

Imported only where Triton is (:mod:`gpt_fast.accel.decode_attention` decides); the launchers run on CUDA
tensors, and in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from gpt_fast.kernels.pdl import NO_PDL, Wrap, pdl_launch, unwrapped, wait_for_inputs

SPLIT_STEPS = 4  # decode steps of models with many kv heads: loop_step()s per split, as one step (decode_launch)
WIDE_WARPS = 8  # decode steps of models with many kv heads: warps per program
MANY_KV_HEADS = 16  # decode steps: kv heads from which a model's programs are many without short splits
SHORT_TILE_ELEMENTS = 2048  # decode steps of few kv heads: query heads x positions x half a head per program
SPLIT_KEYS = 128  # batch-invariant steps: positions per program, at most (:func:`rows_launch`)
TILE_ELEMENTS = 4096  # query heads x positions x half a head per loop step: 32 float32 registers per thread
COMBINE_CHUNK = 8  # splits combined per loop step (:func:`_combine_splits`)
COMBINE_ALL = 16  # splits that a combination reads all, at most, without reading the query's position first
FULL_KV_HEADS = 32  # batch-invariant attention: kv heads for which splits of SPLIT_KEYS positions suffice
SPLIT_PROGRAMS = 384  # a row's programs over all its kv heads, at most (:func:`max_splits`); 16 per kv head at least
ROW_PROGRAMS = 256  # (row, kv head) pairs from which a step's rows alone make programs enough (decode_launch)
ROWS_TILE_ELEMENTS = 8192  # such steps: query heads x positions x half a head per loop step
ROWS_SPLIT = 1024  # such steps: positions per split
DOT_ROWS = 16  # the fewest rows of a tensor-core product: a GQA program's query heads padded to it (decode_launch)
DOT_PAIRS = 64  # (row, kv head) pairs from which a GQA step's products go to the tensor cores (decode_launch)
# caches whose values the tensor cores' TF32 products take exactly
DOT_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
FLOAT8_LARGEST = tl.constexpr(448.0)  # float8 e4m3fn's largest finite value: larger keys and values are stored as it
FLOAT16_LARGEST = tl.constexpr(65504.0)  # float16's: queries beyond it are taken as it by float16 products
MMA16_DTYPES = (torch.float8_e4m3fn, torch.float16)  # caches whose values float16 products take exactly
MMA_PAIRS = 512  # (row, kv head) pairs from which an MHA step over a float8 cache goes to the tensor cores


@dataclass(frozen=True)
class Launch:
    """Positions per loop step, positions per split (a multiple of the step; a query that sees more than
    ``max_splits`` splits of it takes a multiple of it, :func:`_span`), warps per program, splits per row and kv
    head at most (:func:`max_splits` in the launches chosen here); ``dot``: the query heads' scores and weighted
    values as matrix products on the tensor cores (GQA over a 16-bit or float8 cache, MHA over a float8 one:
    :func:`decode_launch`); ``mma16``: those products' operands in float16, not TF32 (a float8 or float16 cache,
    whose values float16 holds exactly; TF32 on others); ``acc_pos``: one query head (MHA) without ``dot``, its
    weighted values summed per position over the loop and over the positions once after it, where the other tiles
    sum a loop step's positions at every step (:func:`_fold_by_position`)."""

    block_s: int
    split_len: int
    warps: int
    max_splits: int
    dot: bool = False
    mma16: bool = False
    acc_pos: bool = False


@triton.jit
def _span(pos, SPLIT_LEN: tl.constexpr, MAX_SPLITS: tl.constexpr, CAPPED: tl.constexpr):
    """The positions per split of a query at position ``pos`` (it sees positions 0 to ``pos``): ``SPLIT_LEN``, or
    the smallest multiple of it that covers them in ``MAX_SPLITS`` splits. A function of the query's position
    alone, never of the cache's length. Without ``CAPPED`` (a cache of at most ``MAX_SPLITS`` splits, so no query
    in it needs more) that is ``SPLIT_LEN``, a constant the compiler sees: computing the span from the position
    costs a short cache 0.5-1 µs per layer on an H200 (docs/bench/HISTORY.md, 2026-11-25c)."""
    if CAPPED:
        span = SPLIT_LEN * tl.cdiv(tl.cdiv(pos + 1, SPLIT_LEN), MAX_SPLITS)
    else:
        span = SPLIT_LEN
    return span


def max_splits(n_kv: int) -> int:
    """Splits per row and kv head, at most: the power of two that keeps a row's programs within
    :data:`SPLIT_PROGRAMS`, 16 at least. On an H200, 8192-position caches (docs/bench/HISTORY.md, 2026-11-25b):
    SmolLM2 (3 kv heads) with a query at position 8000, 56.6 µs with 32 splits, 37.5 with 64, 28.3 with 128 (the
    splits over the whole cache, uncapped: 40.9); Llama-3-8B (8 kv heads) at position 2040, 29.2 µs with 32, 33.4
    with 64, 34.6 with 128 (at position 8000: 94.9, 96.2, 87.2; uncapped: 59.7 and 105.9)."""
    return max(16, 1 << (SPLIT_PROGRAMS // n_kv).bit_length() - 1)


def decode_launch(group: int, head_dim: int, n_kv: int, rows: int = 1, dtype: torch.dtype = torch.bfloat16) -> Launch:
    """The tile of a decode step of ``rows`` rows for ``n_kv`` kv heads of ``group`` query heads and ``head_dim``,
    over a cache of ``dtype``.

    - A server's GQA step (``group`` above 1, fewer than :data:`MANY_KV_HEADS` kv heads, at least
      :data:`DOT_PAIRS` (row, kv head) pairs) over a 16-bit cache, halves of heads of at least :data:`DOT_ROWS`: the
      query heads' scores and weighted values on the tensor cores (``dot``; on a float32 cache such a launch takes
      the reductions), the heads padded to :data:`DOT_ROWS`, 4 warps, in splits of 256 positions in loop steps of
      128, or from :data:`ROW_PROGRAMS` pairs on splits of :data:`ROWS_SPLIT` in loop steps of 64. The reductions
      over a [group, positions, head_dim / 2] tile that the other tiles use move every product between threads. On
      an H200, Llama-3-8B shape, rows around position 512 of a 1024-position paged cache, the kernel alone
      (docs/bench/HISTORY.md, 2026-11-30j): 8 rows 16.2 µs against 51.6 with the reductions, 32 rows 31.4 against 152.3,
      64 rows 58.2 against 290.5. One row keeps the reductions: a tensor-core tile won at position 2040 (15.4
      against 26.4 µs) but lost at positions 100 to 250 (11.3 against 9.7; SmolLM2 8.5 against 6.2).

    - At least :data:`ROW_PROGRAMS` (row, kv head) pairs (a server's step of many sequences): they alone make
      programs enough, so each walks its positions in splits of :data:`ROWS_SPLIT` (one split up to 1024
      positions), in loop steps of as many positions as keep the [group, positions, head_dim / 2] products at
      :data:`ROWS_TILE_ELEMENTS` (16 to 128), over 4 warps: a program keeps its loads in flight without spilling.
      On an H200, Llama-2-7B shape, rows around position 512 of a 1024-position cache, the kernel alone
      (docs/bench/HISTORY.md, 2026-11-29 "batched decode steps"): 8 rows 25.7 µs (static cache) and 30.0 µs (paged)
      against 41.6 and 54.0 µs with the one-row tile below, 64 rows 139.7 and 156.7 against 267.2 and 375.2.

    - At least :data:`MANY_KV_HEADS` kv heads (multi-head attention of a 7B model): the kv heads alone make enough
      programs. Splits of :data:`SPLIT_STEPS` x :func:`loop_step` positions, so that a cache of up to 256 positions
      (Llama-2-7B) is one split and needs no second kernel to combine splits, each split one loop step of
      :data:`WIDE_WARPS` warps: a program then waits for its loads once, not once per 64 positions.
    - Fewer (GQA, and the small models): a few programs walking their loop steps one after another wait for their
      loads at every step. One loop step per split instead, of as many positions as keep the [group, positions,
      head_dim / 2] products at :data:`SHORT_TILE_ELEMENTS` (16 to 64), 4 warps, and a second kernel combines the
      splits.

    Either way a long cache has at most :func:`max_splits` splits per kv head. On an H200 (docs/bench/HISTORY.md,
    2026-11-25a), the kernel alone (query at position 250 of 256; Llama-3-8B at 105), long splits against one-step
    splits: SmolLM2 14.4 against 5.5 µs, Llama-3-8B 18.1 against 8.5 µs, Llama-2-7B 10.9 against 7.0 µs; the whole
    decode step (heuristic tuning, our GEMVs and sampling kernel): SmolLM2 1250 against 1822 tok/s, Llama-3-8B 244.0
    with one-step splits (inductor's attention: 237.0), but Llama-2-7B 278.1 against 271.4, hence its long splits. Its
    split as one step of 256 positions over 8 warps rather than four steps of 64 over 4 warps: Llama-2-7B's 200-token
    generation at 282.8 and 283.2 tok/s against 279.1 on one H200; per layer, the attention's end after ``wqkv``'s
    7.4 µs against 13.5 at position 202, but 5.8 against 4.6 µs at position 7 (docs/bench/HISTORY.md, 2026-11-25g: four
    steps of 64 over 8 warps, two of 128, one of 256 over 16 warps are slower; so is a narrow first step).
    - A float8 cache (``--kv_cache_dtype float8_e4m3fn``) reads half a 16-bit one's bytes, which leaves a server's
      step bound by the arithmetic, not the reads: its GQA tensor-core products take float16 operands (``mma16``:
      float8 values are exact in float16, whose products run at twice TF32's rate and whose tiles take half the
      registers); an MHA step of at least :data:`MMA_PAIRS` pairs goes to the tensor cores too, its one query head
      padded to :data:`DOT_ROWS` rows, 2 warps, loop steps of 64; from :data:`ROW_PROGRAMS` pairs an MHA step keeps
      the many-rows tile with its weighted values summed once after the loop (``acc_pos``). On an H200, rows around
      position 512 of a 1024-position cache, the kernel alone (BENCHMARKS.md, 2026-12-02b), against the 16-bit
      cache's tile: Llama-2-7B 8 rows 20.4 against 23.0 µs (static) and 21.1 against 24.9 (paged), 64 rows 107.7
      against 150.7 and 126.8 against 164.0; Llama-3-8B 8 rows 14.2 against 18.2 and 14.6 against 18.4, 64 rows 38.0
      against 43.7 and 51.6 against 55.2. MHA's tensor-core tile against the many-rows tile summed per position, the
      same way: 8 rows (256 pairs) 22.8 against 20.1 µs (static) and 27.0 against 21.0 (paged), 16 rows 32.6 against
      36.1 and 35.1 against 37.3, 32 rows 66.7 against 73.1 (paged), 64 rows 108.2 against 133.6 and 126.1 against
      137.0: hence :data:`MMA_PAIRS`.

    ``scripts/decode_attention_bench.py`` times the kernel alone (``--rows``: a server's step)."""
    gqa = group > 1 and n_kv < MANY_KV_HEADS and head_dim >= 2 * DOT_ROWS
    float8 = dtype == torch.float8_e4m3fn
    if gqa and dtype in DOT_DTYPES and rows * n_kv >= DOT_PAIRS:
        if rows * n_kv >= ROW_PROGRAMS:
            return Launch(64, ROWS_SPLIT, 4, max_splits(n_kv), dot=True, mma16=float8)
        return Launch(128, 256, 4, max_splits(n_kv), dot=True, mma16=float8)
    if float8 and group == 1 and head_dim >= 2 * DOT_ROWS and rows * n_kv >= MMA_PAIRS:
        return Launch(64, ROWS_SPLIT, 2, max_splits(n_kv), dot=True, mma16=True)
    if float8 and group == 1 and rows * n_kv >= ROW_PROGRAMS:
        return Launch(128, ROWS_SPLIT, 4, max_splits(n_kv), acc_pos=True)
    if rows * n_kv >= ROW_PROGRAMS:
        tile = triton.next_power_of_2(group) * triton.next_power_of_2(head_dim // 2)
        return Launch(max(16, min(128, ROWS_TILE_ELEMENTS // tile)), ROWS_SPLIT, 4, max_splits(n_kv))
    if n_kv >= MANY_KV_HEADS:
        split_len = SPLIT_STEPS * loop_step(group, head_dim)
        return Launch(split_len, split_len, WIDE_WARPS, max_splits(n_kv))
    tile = triton.next_power_of_2(group) * triton.next_power_of_2(head_dim // 2)
    block_s = max(16, min(64, SHORT_TILE_ELEMENTS // tile))
    return Launch(block_s, block_s, 4, max_splits(n_kv))


def loop_step(group: int, head_dim: int) -> int:
    """Positions per loop step over a long split: as many as keep the [group, positions, head_dim / 2] products at
    :data:`TILE_ELEMENTS` (8 to 64)."""
    tile = triton.next_power_of_2(group) * triton.next_power_of_2(head_dim // 2)
    return max(8, min(64, TILE_ELEMENTS // tile))


def rows_launch(group: int, head_dim: int, n_kv: int) -> Launch:
    """The tile of the batch-invariant attention: :func:`loop_step` positions per loop step, 4 warps, and splits shorter
    for fewer kv heads: the multiple of the loop step nearest :data:`SPLIT_KEYS` x ``n_kv`` / :data:`FULL_KV_HEADS`
    positions (one loop step at least, :data:`SPLIT_KEYS` at most), so that a query row spreads over as many programs as
    a model with 32 kv heads. With SmolLM2's 3 kv heads, splits of four steps leave a one-row step six programs over a
    704-position cache, each running its loop steps one after another (15.6 µs per layer on an H200, against 8.5 µs with
    one step per split: docs/bench/HISTORY.md, 2026-11-23g). A function of the model alone: never of the number of rows,
    nor of the cache's length, which a request's token count sets (a token's result must not depend on how many tokens
    were asked for)."""
    block_s = loop_step(group, head_dim)
    steps = max(1, min(SPLIT_KEYS // block_s, round(SPLIT_KEYS * n_kv / FULL_KV_HEADS / block_s)))
    return Launch(block_s, steps * block_s, 4, max_splits(n_kv))


@triton.jit
def _rotate(x1, x2, cos, sin, dtype):
    """Rotary embedding of a vector's two halves in float32, rounded to ``dtype`` and back."""
    return (x1 * cos - x2 * sin).to(dtype).to(tl.float32), (x2 * cos + x1 * sin).to(dtype).to(tl.float32)


@triton.jit
def _capped(scores, softcap, SOFTCAP: tl.constexpr):
    """``softcap * tanh(scores / softcap)`` when ``SOFTCAP`` (tanh through exp: saturates to ±1, never NaN), in
    float32: inductor passes float scalars such as the scale and the cap as float64, which would otherwise promote
    the running softmax state out of its loop's type."""
    if SOFTCAP:
        scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
    return scores.to(tl.float32)


@triton.jit
def _dots(q1, q2, k1, k2, DOT: tl.constexpr = False, MMA16: tl.constexpr = False):
    """Products of the queries' halves [G, H] with N keys' halves [N, H]: [G, N]. One query head (MHA) is a plain
    2-D reduction; several are a 3-D one, or with ``DOT`` (G and N at least 16, the keys as stored) two matrix
    products in TF32, which holds the 16-bit keys and the queries rounded to their dtype (:func:`_rotate`) exactly:
    each product exact in float32, as the reduction's. (Triton 3.6's interpreter multiplies 16-bit operands of a
    matrix product wrongly: float32 operands are right in both.) ``MMA16``: float16 operands, which hold float8 keys
    exactly and the queries but for those beyond float16's range, taken as its largest value, and tiny ones, whose
    products are below a score's rounding; each product exact in the float32 sums."""
    if MMA16:
        h1 = tl.clamp(q1, -FLOAT16_LARGEST, FLOAT16_LARGEST).to(tl.float16)
        h2 = tl.clamp(q2, -FLOAT16_LARGEST, FLOAT16_LARGEST).to(tl.float16)
        dots = tl.dot(h1, tl.trans(k1.to(tl.float16))) + tl.dot(h2, tl.trans(k2.to(tl.float16)))
    elif DOT:
        dots = tl.dot(q1, tl.trans(k1.to(tl.float32)), input_precision="tf32") + tl.dot(
            q2, tl.trans(k2.to(tl.float32)), input_precision="tf32"
        )
    elif q1.shape[0] == 1:
        dots = (tl.sum(q1 * k1, axis=1) + tl.sum(q2 * k2, axis=1))[None, :]
    else:
        dots = tl.sum(q1[:, None, :] * k1[None, :, :], axis=2) + tl.sum(q2[:, None, :] * k2[None, :, :], axis=2)
    return dots


@triton.jit
def _weighted(p, v, DOT: tl.constexpr = False, MMA16: tl.constexpr = False):
    """The weights [G, N] times N values' half [N, H], summed over the positions: [G, H]; with ``DOT`` (G and N at
    least 16) a matrix product in TF32, which holds 16-bit values exactly and the weights to 11 bits; ``MMA16``: in
    float16, which holds float8 values exactly and the weights to 11 bits as well."""
    if MMA16:
        weighted = tl.dot(p.to(tl.float16), v.to(tl.float16))
    elif DOT:
        weighted = tl.dot(p, v, input_precision="tf32")
    elif p.shape[0] == 1:
        weighted = tl.sum(tl.sum(p, axis=0)[:, None] * v, axis=0)[None, :]
    else:
        weighted = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return weighted


@triton.jit
def _online_softmax(m_i, l_i, acc1, acc2, scores, v1, v2, DOT: tl.constexpr = False, MMA16: tl.constexpr = False):
    """Fold the scores [G, N] of N more positions and their values' halves [N, H] into the running maximum and
    sum [G] and weighted sums [G, H]; rows still without a position stay at -inf, 0, 0 (no NaN)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc1 = acc1 * alpha[:, None] + _weighted(p, v1, DOT, MMA16)
    acc2 = acc2 * alpha[:, None] + _weighted(p, v2, DOT, MMA16)
    return m_new, l_i, acc1, acc2


@triton.jit
def _row_cache(kv_ptr, table_ptr, table_stride, row, h, S, H_KV: tl.constexpr, HALF: tl.constexpr, PAGED: tl.constexpr):
    """Where the keys of cache row ``row`` and kv head ``h`` start (a static cache's position 0, a paged cache's
    block 0 at offset 0: :func:`_offsets` from there), and the row of the block table (paged)."""
    if PAGED:
        cache = kv_ptr + h * (2 * HALF)
        table = table_ptr + row * table_stride
    else:
        cache = kv_ptr + (row * H_KV + h).to(tl.int64) * S * (2 * HALF)
        table = table_ptr
    return cache, table


@triton.jit
def _offsets(
    table, positions, mask, H_KV: tl.constexpr, HALF: tl.constexpr, CACHE_BLOCK: tl.constexpr, PAGED: tl.constexpr
):
    """How far the keys of ``positions`` are from a row's first (:func:`_row_cache`): one after the other in a static
    cache; in a paged one, position p in block ``table[p // CACHE_BLOCK]`` at offset ``p % CACHE_BLOCK``, each
    position holding every kv head. The table is read where ``mask`` is true (elsewhere the sink, block 0)."""
    if PAGED:
        blocks = tl.load(table + positions // CACHE_BLOCK, mask=mask, other=0)  # int64: no overflow in a large cache
        offsets = (blocks * CACHE_BLOCK + positions % CACHE_BLOCK) * (H_KV * 2 * HALF)
    else:
        offsets = positions * (2 * HALF)
    return offsets


@triton.jit
def _cached_tile(
    cache,
    table,
    first,
    lo,
    end,
    d,
    d_in,
    values_offset,
    H_KV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    PAGED: tl.constexpr,
):
    """The cached keys' and values' halves [BLOCK, HALF_PAD] of positions ``first`` to ``first + BLOCK - 1``, as
    stored (zeros outside [``lo``, ``end``)), and which positions are in it [BLOCK] (``cache`` and ``table``: one
    row's and kv head's, :func:`_row_cache`)."""
    keys = first + tl.arange(0, BLOCK)
    valid = (keys >= lo) & (keys < end)
    at = cache + _offsets(table, keys, valid, H_KV, HALF, CACHE_BLOCK, PAGED)[:, None] + d[None, :]  # [BLOCK, HALF_PAD]
    at_in = valid[:, None] & d_in[None, :]
    k1 = tl.load(at, mask=at_in, other=0.0)
    k2 = tl.load(at + HALF, mask=at_in, other=0.0)
    v1 = tl.load(at + values_offset, mask=at_in, other=0.0)
    v2 = tl.load(at + values_offset + HALF, mask=at_in, other=0.0)
    return valid, k1, k2, v1, v2


@triton.jit
def _fold_tile(
    q1,
    q2,
    m_i,
    l_i,
    acc1,
    acc2,
    valid,
    k1,
    k2,
    v1,
    v2,
    scale,
    softcap,
    SOFTCAP: tl.constexpr,
    DOT: tl.constexpr,
    MMA16: tl.constexpr,
    ACC_POS: tl.constexpr,
):
    """Fold a tile of :func:`_cached_tile` into the running softmax state of the queries' halves [G, HALF_PAD]; a
    tile without a position in it leaves the state as it was. ``DOT``: on the tensor cores (:func:`_dots`), with
    float16 operands where ``MMA16``; ``ACC_POS``: weighted values per position (:func:`_fold_by_position`)."""
    if ACC_POS:
        m_i, l_i, acc1, acc2 = _fold_by_position(
            q1, q2, m_i, l_i, acc1, acc2, valid, k1, k2, v1, v2, scale, softcap, SOFTCAP
        )
    else:
        if not DOT:  # the reductions multiply in float32; the tensor cores take the keys as stored
            k1, k2 = k1.to(tl.float32), k2.to(tl.float32)
        dots = _dots(q1, q2, k1, k2, DOT, MMA16)
        scores = tl.where(valid[None, :], _capped(dots * scale, softcap, SOFTCAP), float("-inf"))  # [G, BLOCK]
        if not MMA16:  # float16 products take the values as stored
            v1, v2 = v1.to(tl.float32), v2.to(tl.float32)
        m_i, l_i, acc1, acc2 = _online_softmax(m_i, l_i, acc1, acc2, scores, v1, v2, DOT, MMA16)
    return m_i, l_i, acc1, acc2


@triton.jit
def _fold_by_position(q1, q2, m_i, l_i, pacc1, pacc2, valid, k1, k2, v1, v2, scale, softcap, SOFTCAP: tl.constexpr):
    """:func:`_fold_tile` for one query head (MHA) whose weighted values stay apart per position of the loop step,
    ``pacc1``, ``pacc2`` [BLOCK, HALF_PAD] (rescaled with the running maximum, as a sum is): nothing is summed over
    positions inside the loop, where the other tiles sum a loop step's positions across threads at every step;
    the sum over them comes once after the loop. The state ``m_i``, ``l_i`` is [1]."""
    dots = _dots(q1, q2, k1.to(tl.float32), k2.to(tl.float32))  # [1, BLOCK]
    scores = tl.where(valid[None, :], _capped(dots * scale, softcap, SOFTCAP), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)  # [1]
    p = tl.exp(scores - m_safe[:, None])  # [1, BLOCK]
    weights = tl.sum(p, axis=0)[:, None]  # [BLOCK, 1]: the one row's weights down the positions
    pacc1 = pacc1 * alpha[:, None] + weights * v1.to(tl.float32)
    pacc2 = pacc2 * alpha[:, None] + weights * v2.to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, axis=1), pacc1, pacc2


@triton.jit
def _fold_own(q1, q2, m_i, l_i, acc1, acc2, own, k1, k2, v1, v2, scale, softcap, SOFTCAP: tl.constexpr):
    """Fold one position, the step's own key's and value's halves [HALF_PAD] (where ``own``), into the running
    softmax state of the 16 padded query rows [G, HALF_PAD] of a tensor-core tile, as :func:`_online_softmax` folds
    a tile's, with reductions over the head only: on an H200 (torch 2.11, Triton 3.6), :func:`_dots` and
    :func:`_weighted` over a tile of one position counted it once per thread that held it with 16 rows (outputs 8
    times too large at a cache's first position), where Triton's interpreter counted it once."""
    dots = tl.sum(q1 * k1[None, :], axis=1) + tl.sum(q2 * k2[None, :], axis=1)  # [G]
    scores = tl.where(own, _capped(dots * scale, softcap, SOFTCAP), float("-inf"))
    m_new = tl.maximum(m_i, scores)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe)  # [G]
    acc1 = acc1 * alpha[:, None] + p[:, None] * v1[None, :]
    acc2 = acc2 * alpha[:, None] + p[:, None] * v2[None, :]
    return m_new, l_i * alpha + p, acc1, acc2


@triton.jit
def _rotated_key_value(k_row, v_row, d, cos, sin, HALF: tl.constexpr, d_in):
    """A new key (at ``k_row``, one kv head's), rotated and rounded to its dtype, and its value (at ``v_row``): four
    halves [HALF_PAD] in float32."""
    k1, k2 = _rotate(
        tl.load(k_row + d, mask=d_in, other=0.0).to(tl.float32),
        tl.load(k_row + d + HALF, mask=d_in, other=0.0).to(tl.float32),
        cos,
        sin,
        k_row.dtype.element_ty,
    )
    v1 = tl.load(v_row + d, mask=d_in, other=0.0).to(tl.float32)
    v2 = tl.load(v_row + d + HALF, mask=d_in, other=0.0).to(tl.float32)
    return k1, k2, v1, v2


@triton.jit
def _in_range(x, dtype):
    """``x`` clamped to a float8 ``dtype``'s largest value, as :func:`gpt_fast.model.cache.stored` clamps what it
    writes (a GPU's conversion saturates too, Triton's interpreter does not); other dtypes' as it is."""
    if dtype.is_fp8():
        x = tl.clamp(x, -FLOAT8_LARGEST, FLOAT8_LARGEST)
    return x


@triton.jit
def _as_stored(x, dtype):
    """``x`` (float32) as the cache of ``dtype`` holds it: what a later step reads of it."""
    return _in_range(x, dtype).to(dtype).to(tl.float32)


@triton.jit
def _store_key_value(at, values_offset, k1, k2, v1, v2, mask, HALF: tl.constexpr):
    """A key's and a value's halves into the cache at ``at`` (the key's first element), rounded to its dtype."""
    dtype = at.dtype.element_ty
    tl.store(at, _in_range(k1, dtype).to(dtype), mask=mask)
    tl.store(at + HALF, _in_range(k2, dtype).to(dtype), mask=mask)
    tl.store(at + values_offset, _in_range(v1, dtype).to(dtype), mask=mask)
    tl.store(at + values_offset + HALF, _in_range(v2, dtype).to(dtype), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _write_rotated(
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    kv_ptr,
    pos_ptr,
    k_stride_b,
    k_stride_h,
    v_stride_b,
    v_stride_h,
    first_row,
    T,
    values_offset,
    S,
    H_KV: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Program (query row, kv head): the row's new key, rotated, and value into the cache at the row's position
    (query rows as in :func:`_decode_attention_split`, their tables and positions one per query row)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HALF_PAD)
    d_in = d < HALF
    cos = tl.load(cos_ptr + b * HALF + d, mask=d_in, other=0.0)
    sin = tl.load(sin_ptr + b * HALF + d, mask=d_in, other=0.0)
    k1, k2, v1, v2 = _rotated_key_value(
        k_ptr + b * k_stride_b + h * k_stride_h, v_ptr + b * v_stride_b + h * v_stride_h, d, cos, sin, HALF, d_in
    )
    cache = kv_ptr + ((first_row + b // T) * H_KV + h).to(tl.int64) * S * (2 * HALF)
    _store_key_value(cache + tl.load(pos_ptr + b) * (2 * HALF) + d, values_offset, k1, k2, v1, v2, d_in, HALF)


@triton.jit(do_not_specialize=["T"])
def _decode_attention_split(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    kv_ptr,
    pos_ptr,
    out_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    q_stride_b,
    q_stride_h,
    k_stride_b,
    k_stride_h,
    v_stride_b,
    v_stride_h,
    cos_stride,
    pos_stride,
    first_row,
    T,
    values_offset,
    S,
    scale,
    softcap,
    window,
    table_ptr,
    table_stride,
    H_KV: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
    SPLITS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    CAPPED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    FROM_CACHE: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    PAGED: tl.constexpr,
    PDL: tl.constexpr,
    DOT: tl.constexpr,
    MMA16: tl.constexpr,
    ACC_POS: tl.constexpr,
):
    """Program (query row b * H_KV + kv head, split): the GROUP query heads of one kv head over the split's
    positions (:func:`_span` of them from ``split`` times that on; a split past the query's position has none). A
    query row is one position of one of the cache's rows, ``T`` positions per cache row. Without ``FROM_CACHE``
    (one position per row) the step's own key and value come in registers and are written here; with it every key
    up to the query's position is read from the cache, where :func:`_write_rotated` put them. With ``PAGED`` the
    cache is in blocks of ``CACHE_BLOCK`` positions, which the cache row's row of the block table (``table_ptr``)
    names (:func:`_offsets`); ``PAGED`` is a constexpr, so that a static cache's compiled kernel has none of the
    paged code (nor reads the table). ``DOT``, ``MMA16``, ``ACC_POS``: as :class:`Launch`'s ``dot``, ``mma16``,
    ``acc_pos``.

    The first loop step's cached keys and values are loaded before the kernel waits for the one before it
    (:mod:`gpt_fast.kernels.pdl`), as a GEMV's first weights are: earlier steps wrote them, and the position and the
    block table are inputs of the whole step. With ``FROM_CACHE`` the kernel before writes keys, so it is launched
    without PDL. On an H200 (docs/bench/HISTORY.md, 2026-11-25j) Llama-2-7B's 200-token generations run at 290.3 tok/s
    with these early loads against 286.4 without, SmolLM2's at 1927 against 1834: the attention's end after
    ``wqkv``'s 5.0-5.1 µs per layer against 5.8-7.5."""
    b = tl.program_id(0) // H_KV
    h = tl.program_id(0) % H_KV
    split = tl.program_id(1)
    pos = tl.load(pos_ptr + b * pos_stride)  # a graph input, not the kernel before's output
    d = tl.arange(0, HALF_PAD)
    d_in = d < HALF
    cache, table = _row_cache(kv_ptr, table_ptr, table_stride, first_row + b // T, h, S, H_KV, HALF, PAGED)
    span = _span(pos, SPLIT_LEN, MAX_SPLITS, CAPPED)
    start = split * span
    seen = pos  # positions before the query's own come from the cache, and with FROM_CACHE its own too
    if FROM_CACHE:
        seen = pos + 1
    end = tl.minimum(start + span, seen)  # cached positions this split reads: [lo, end)
    lo = start
    if WINDOW:
        lo = tl.maximum(start, pos - window + 1)
    begin = start + (lo - start) // BLOCK_S * BLOCK_S  # the first loop step's first position
    # The first loop step's keys and values before the wait: earlier steps wrote them (PDL: without FROM_CACHE only)
    valid, k1, k2, v1, v2 = _cached_tile(
        cache, table, begin, lo, end, d, d_in, values_offset, H_KV, HALF, BLOCK_S, CACHE_BLOCK, PAGED
    )
    wait_for_inputs(PDL)
    g = tl.arange(0, GROUP_PAD)
    g_in = g < GROUP
    heads = h * GROUP + g  # the query heads of kv head h
    cos = tl.load(cos_ptr + b * cos_stride + d, mask=d_in, other=0.0)
    sin = tl.load(sin_ptr + b * cos_stride + d, mask=d_in, other=0.0)
    q_at = q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + d[None, :]  # [G, HALF_PAD]
    q_in = g_in[:, None] & d_in[None, :]
    q1 = tl.load(q_at, mask=q_in, other=0.0).to(tl.float32)
    q2 = tl.load(q_at + HALF, mask=q_in, other=0.0).to(tl.float32)
    q1, q2 = _rotate(q1, q2, cos[None, :], sin[None, :], q_ptr.dtype.element_ty)

    m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_PAD,), tl.float32)
    if ACC_POS:  # one query head: its weighted values per position [BLOCK_S, HALF_PAD], summed after the loop
        acc1 = tl.zeros((BLOCK_S, HALF_PAD), tl.float32)
        acc2 = tl.zeros((BLOCK_S, HALF_PAD), tl.float32)
    else:
        acc1 = tl.zeros((GROUP_PAD, HALF_PAD), tl.float32)
        acc2 = tl.zeros((GROUP_PAD, HALF_PAD), tl.float32)
    m_i, l_i, acc1, acc2 = _fold_tile(
        q1, q2, m_i, l_i, acc1, acc2, valid, k1, k2, v1, v2, scale, softcap, SOFTCAP, DOT, MMA16, ACC_POS
    )
    for first in range(begin + BLOCK_S, end, BLOCK_S):
        valid, k1, k2, v1, v2 = _cached_tile(
            cache, table, first, lo, end, d, d_in, values_offset, H_KV, HALF, BLOCK_S, CACHE_BLOCK, PAGED
        )
        m_i, l_i, acc1, acc2 = _fold_tile(
            q1, q2, m_i, l_i, acc1, acc2, valid, k1, k2, v1, v2, scale, softcap, SOFTCAP, DOT, MMA16, ACC_POS
        )
    if ACC_POS:
        acc1 = tl.sum(acc1, axis=0)[None, :]  # [1, HALF_PAD]
        acc2 = tl.sum(acc2, axis=0)[None, :]

    if not FROM_CACHE:  # the step's own key and value: rotated here, written by the split that holds the position
        own = (pos >= start) & (pos < start + span)
        k1, k2, v1, v2 = _rotated_key_value(
            k_ptr + b * k_stride_b + h * k_stride_h, v_ptr + b * v_stride_b + h * v_stride_h, d, cos, sin, HALF, d_in
        )
        stored_as = kv_ptr.dtype.element_ty  # folded as the cache holds them, as the model's code reads them back
        k1, k2 = _as_stored(k1, stored_as), _as_stored(k2, stored_as)
        v1, v2 = _as_stored(v1, stored_as), _as_stored(v2, stored_as)
        at = cache + _offsets(table, pos, own, H_KV, HALF, CACHE_BLOCK, PAGED) + d
        _store_key_value(at, values_offset, k1, k2, v1, v2, d_in & own, HALF)
        if DOT:
            m_i, l_i, acc1, acc2 = _fold_own(q1, q2, m_i, l_i, acc1, acc2, own, k1, k2, v1, v2, scale, softcap, SOFTCAP)
        else:
            dots = _dots(q1, q2, k1[None, :], k2[None, :])  # [G, 1]
            scores = tl.where(own, _capped(dots * scale, softcap, SOFTCAP), float("-inf"))
            m_i, l_i, acc1, acc2 = _online_softmax(m_i, l_i, acc1, acc2, scores, v1[None, :], v2[None, :])

    rows = b * H_KV * GROUP + heads  # [G]: index of (row, query head)
    out_in = g_in[:, None] & d_in[None, :]
    if SPLITS == 1:
        out = out_ptr + rows[:, None] * (2 * HALF) + d[None, :]
        tl.store(out, (acc1 / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_in)
        tl.store(out + HALF, (acc2 / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_in)
    else:
        tl.store(m_ptr + rows * SPLITS + split, m_i, mask=g_in)
        tl.store(l_ptr + rows * SPLITS + split, l_i, mask=g_in)
        partial = acc_ptr + (rows[:, None] * SPLITS + split) * (2 * HALF) + d[None, :]
        tl.store(partial, acc1, mask=out_in)
        tl.store(partial + HALF, acc2, mask=out_in)


@triton.jit(do_not_specialize=["splits"])
def _combine_splits(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    pos_ptr,
    pos_stride,
    n_head,
    splits,
    SPLIT_LEN: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    CAPPED: tl.constexpr,
    TRIM: tl.constexpr,
    CHUNK: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (query row b * n_head + query head): the splits' partial results, rescaled to their common maximum,
    summed, normalized. Splits that saw no position (past the query's, or before a sliding window) carry -inf and
    weigh 0; the split holding the query's own position always saw one. With ``TRIM`` (many splits) only those that
    cover the query's positions are read (:func:`_span`), after a load of its position that a few splits are not
    worth waiting for: the others would add exact zeros, so the result is the same.

    The sum's order is the same for every cache length, so that a token's result does not depend on how long its
    request's cache is: split i is added into slot i % CHUNK of a fixed [CHUNK] accumulator, one chunk of splits
    after the other, and the slots are summed last in one fixed-shape reduction. ``splits`` is a runtime argument,
    not specialized, so every cache length runs the same compiled code. (A reduction over all splits at once,
    padded to a power of two, would change its order and where the compiler fuses a multiply into an add with the
    padded size, i.e. with the cache's length: docs/bench/HISTORY.md, 2026-11-23h.)"""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    used = splits
    if TRIM:
        pos = tl.load(pos_ptr + row // n_head * pos_stride)
        used = tl.cdiv(pos + 1, _span(pos, SPLIT_LEN, MAX_SPLITS, CAPPED))  # the splits that cover positions 0 to pos
    d = tl.arange(0, HALF_PAD)
    d_in = d < HALF
    m = tl.full((CHUNK,), float("-inf"), tl.float32)
    for first in range(0, used, CHUNK):
        sp = first + tl.arange(0, CHUNK)
        m = tl.maximum(m, tl.load(m_ptr + row * splits + sp, mask=sp < used, other=float("-inf")))
    top = tl.max(m, axis=0)
    total = tl.zeros((CHUNK,), tl.float32)
    y1 = tl.zeros((CHUNK, HALF_PAD), tl.float32)
    y2 = tl.zeros((CHUNK, HALF_PAD), tl.float32)
    for first in range(0, used, CHUNK):
        sp = first + tl.arange(0, CHUNK)
        sp_in = sp < used
        weights = tl.exp(tl.load(m_ptr + row * splits + sp, mask=sp_in, other=float("-inf")) - top)  # [CHUNK]
        total += weights * tl.load(l_ptr + row * splits + sp, mask=sp_in, other=0.0)
        at = acc_ptr + (row * splits + sp[:, None]) * (2 * HALF) + d[None, :]  # [CHUNK, HALF_PAD]
        at_in = sp_in[:, None] & d_in[None, :]
        y1 += weights[:, None] * tl.load(at, mask=at_in, other=0.0)
        y2 += weights[:, None] * tl.load(at + HALF, mask=at_in, other=0.0)
    norm = tl.sum(total, axis=0)
    out = out_ptr + row * (2 * HALF) + d
    tl.store(out, (tl.sum(y1, axis=0) / norm).to(out_ptr.dtype.element_ty), mask=d_in)
    tl.store(out + HALF, (tl.sum(y2, axis=0) / norm).to(out_ptr.dtype.element_ty), mask=d_in)


def _row_stride(t: torch.Tensor) -> int:
    """The stride between rows of a tensor [R, ...] read once per row: 0 when one row is shared by all."""
    return 0 if t.shape[0] == 1 else t.stride(0)


@dataclass(frozen=True)
class _Rows:
    """A launch's query rows: queries ``q`` [R, H, D], new keys and values [R, H_kv, D] (heads contiguous), rotary
    tables [R or 1, D/2] and positions [R or 1, 1] (one shared by all rows, or each row's own), and how many query
    rows each cache row has (``per_cache_row``, from ``first_row`` on)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor
    first_row: int
    per_cache_row: int


def _cache_shape(kv: torch.Tensor, table: torch.Tensor | None) -> tuple[int, int]:
    """The kv heads of the cache ``kv`` and the positions of each of its rows: static, ``kv`` [2, R, H_kv, S, D];
    paged, ``kv`` [2, N, block_size, H_kv, D] with the block table ``table`` [R, W] (W blocks per row)."""
    if table is None:
        return kv.shape[2], kv.shape[3]
    return kv.shape[3], table.shape[1] * kv.shape[2]


def _attend(
    rows: _Rows,
    kv: torch.Tensor,
    table: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    window: int | None,
    launch: Launch | None,
    wrap: Wrap,
    from_cache: bool,
    pdl: dict[str, Any],
) -> torch.Tensor:
    """Launch the attention kernel (and the combination of its splits) over ``rows`` and the cache ``kv`` (paged
    with ``table``: :func:`_cache_shape`), with the launch keywords ``pdl`` (:func:`gpt_fast.kernels.pdl.pdl_launch`);
    returns [R, H, D]."""
    n_rows, n_head, head_dim = rows.q.shape
    n_kv, max_len = _cache_shape(kv, table)
    assert rows.q.stride(-1) == rows.k.stride(-1) == rows.v.stride(-1) == 1 and kv.is_contiguous()
    assert table is None or (table.dtype == torch.int64 and table.stride(1) == 1)
    group, half = n_head // n_kv, head_dim // 2
    launch = launch or decode_launch(group, head_dim, n_kv, n_rows, kv.dtype)
    dot = launch.dot and kv.dtype in DOT_DTYPES and head_dim >= 2 * DOT_ROWS  # a float32 cache: the reductions
    mma16 = dot and launch.mma16 and kv.dtype in MMA16_DTYPES  # elsewhere TF32
    acc_pos = launch.acc_pos and group == 1 and not dot
    needed = triton.cdiv(max_len, launch.split_len)
    capped = needed > launch.max_splits
    splits = min(needed, launch.max_splits)
    out = torch.empty((n_rows, n_head, head_dim), dtype=rows.q.dtype, device=rows.q.device)
    partials = [out, out, out]  # unused with one split
    if splits > 1:  # each split's maximum and sum [R * H, splits] and weighted sum of values [R * H, splits, D]
        shapes = ((n_rows * n_head, splits), (n_rows * n_head, splits), (n_rows * n_head, splits, head_dim))
        partials = [torch.empty(shape, dtype=torch.float32, device=rows.q.device) for shape in shapes]
    wrap(_decode_attention_split)[(n_rows * n_kv, splits)](
        rows.q,
        rows.k,
        rows.v,
        rows.cos,
        rows.sin,
        kv,
        rows.positions,
        out,
        *partials,
        rows.q.stride(0),
        rows.q.stride(1),
        rows.k.stride(0),
        rows.k.stride(1),
        rows.v.stride(0),
        rows.v.stride(1),
        _row_stride(rows.cos),
        _row_stride(rows.positions),
        rows.first_row,
        rows.per_cache_row,
        kv.stride(0),
        max_len,
        scale,
        1.0 if softcap is None else softcap,
        max_len if window is None else window,
        rows.positions if table is None else table,  # a static cache's kernel has no table to read
        0 if table is None else table.stride(0),
        H_KV=n_kv,
        GROUP=group,
        GROUP_PAD=max(DOT_ROWS, triton.next_power_of_2(group)) if dot else triton.next_power_of_2(group),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        BLOCK_S=launch.block_s,
        SPLIT_LEN=launch.split_len,
        SPLITS=splits,
        MAX_SPLITS=launch.max_splits,
        CAPPED=capped,
        SOFTCAP=softcap is not None,
        WINDOW=window is not None,
        FROM_CACHE=from_cache,
        CACHE_BLOCK=1 if table is None else kv.shape[2],
        PAGED=table is not None,
        DOT=dot,
        MMA16=mma16,
        ACC_POS=acc_pos,
        num_warps=launch.warps,
        **pdl,
    )
    if splits > 1:
        wrap(_combine_splits)[(n_rows * n_head,)](
            *partials,
            out,
            rows.positions,
            _row_stride(rows.positions),
            n_head,
            splits,
            SPLIT_LEN=launch.split_len,
            MAX_SPLITS=launch.max_splits,
            CAPPED=capped,
            TRIM=splits > COMBINE_ALL,
            CHUNK=COMBINE_CHUNK,
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            num_warps=launch.warps,
            **pdl,
        )
    return out


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    input_pos: torch.Tensor,
    first_row: int,
    scale: float,
    softcap: float | None,
    window: int | None,
    table: torch.Tensor | None = None,
    launch: Launch | None = None,
    wrap: Wrap = unwrapped,
    pdl: bool = False,
) -> torch.Tensor:
    """Attention of one query position per row, the step's key and value written into the cache first.

    ``q`` [B, 1, H, D], ``k`` and ``v`` [B, 1, H_kv, D] before the rotary embedding (heads contiguous in memory);
    ``cos``/``sin`` [1, D/2] (shared) or [B, 1, D/2] (each row's); ``kv`` the cache, whose rows ``first_row`` to
    ``first_row + B - 1`` are these rows (written in place at the position): static [2, R, H_kv, S, D], or, given
    the block table ``table`` [R, W] (int64), paged [2, N, block_size, H_kv, D], a row's position p in block
    ``table[row, p // block_size]`` at offset ``p % block_size`` (:class:`gpt_fast.model.cache.PagedKVCache`);
    ``input_pos`` [1] (shared) or [B, 1]. Scores are scaled by ``scale``, soft-capped by ``softcap`` when given, and
    only the last ``window`` positions are seen when given. ``pdl``: the kernels are launched with programmatic
    dependent launch where the GPU has it, each waiting for its inputs before it reads any
    (:mod:`gpt_fast.kernels.pdl`). Returns [B, 1, H, D] in ``q``'s dtype."""
    half = q.shape[-1] // 2
    rows = _Rows(
        q[:, 0], k[:, 0], v[:, 0], cos.reshape(-1, half), sin.reshape(-1, half), input_pos.reshape(-1, 1), first_row, 1
    )
    launch_pdl = pdl_launch(q.device, pdl)
    return _attend(rows, kv, table, scale, softcap, window, launch, wrap, from_cache=False, pdl=launch_pdl)[:, None]


def rows_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    input_pos: torch.Tensor,
    first_row: int,
    scale: float,
    softcap: float | None,
    window: int | None,
    launch: Launch | None = None,
    wrap: Wrap = unwrapped,
) -> torch.Tensor:
    """The batch-invariant attention of T query positions per row (a decode step's one, a verify step's k + 1):
    every new key and value rotated and written into the cache, then each query over the cache up to its position.

    ``q`` [B, T, H, D], ``k`` and ``v`` [B, T, H_kv, D] before the rotary embedding (heads contiguous);
    ``cos``/``sin`` [T, D/2] (shared by the rows) or [B, T, D/2]; ``input_pos`` [T] or [B, T]; the rest as
    :func:`decode_attention`. Returns [B, T, H, D] in ``q``'s dtype."""
    bsz, seqlen, n_head, head_dim = q.shape
    half, n_kv = head_dim // 2, kv.shape[2]
    positions = input_pos.expand(bsz, seqlen).reshape(-1, 1)  # [B * T, 1]: one per query row

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [T or B, T, ...] -> [B * T, ...], a view where the layout allows
        return t.expand(bsz, seqlen, *t.shape[-2:] if t.dim() == 4 else t.shape[-1:]).flatten(0, 1)

    cos, sin = (per_row(t).contiguous() for t in (cos, sin))  # [B * T, D/2]
    rows = _Rows(per_row(q), per_row(k), per_row(v), cos, sin, positions.contiguous(), first_row, seqlen)
    launch = launch or rows_launch(n_head // n_kv, head_dim, n_kv)
    wrap(_write_rotated)[(bsz * seqlen, n_kv)](
        rows.k,
        rows.v,
        cos,
        sin,
        kv,
        rows.positions,
        rows.k.stride(0),
        rows.k.stride(1),
        rows.v.stride(0),
        rows.v.stride(1),
        first_row,
        seqlen,
        kv.stride(0),
        kv.shape[3],
        H_KV=n_kv,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
    )
    out = _attend(rows, kv, None, scale, softcap, window, launch, wrap, from_cache=True, pdl=NO_PDL)
    return out.view(bsz, seqlen, n_head, head_dim)
