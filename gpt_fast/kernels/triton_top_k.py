"""Triton kernels for top-k sampling of 16-bit logits, in two kernels spread over many programs per row.

Why: ``torch.topk`` selects the k-th largest logit by radix select in about sixteen small kernels; with the softmax and
the draw after it, top-k sampling takes about 44-51 µs per token on an H200 for 32000-49152 logits
(docs/bench/HISTORY.md, 2026-11-24j), 7-8 % of a SmolLM2-sized decode step. A single-program radix select is slower
still (docs/bench/HISTORY.md, 2026-11-24i): one multiprocessor walking the row several times.

1. :func:`_count`: each program takes ``CHUNK`` logits of a row and adds each one's 16-bit order key (:func:`_keys`)
   to the row's histogram of 65536 bins (global atomics), and its largest key to the row's maximum. The row's last
   program to finish (a ticket counter) walks the histogram down from that maximum to the bin of the k-th largest
   key, and stores that key, how many of the logits equal to it are candidates, and how many there are.
2. :func:`_draw`: each program takes the same chunk, scores its candidates ``x / T - log(noise[id])`` (the
   exponential race: the largest score is a sample from the softmax of ``x / T`` over the candidates) and keeps its
   best; the row's last program reduces the programs' bests to the token.

Semantics, exactly, for ``logits`` [B, V] (bfloat16 or float16; no NaN), ``noise`` [B, V] float32 Exp(1) draws, one
per vocabulary id, ``k`` >= 1: the candidates are the ``min(k, V)`` largest logits, of those equal to the k-th
largest the lowest vocabulary ids first; the token is the candidate of the largest score in float32, the lowest id of
equal scores.

Imported only where Triton is; the launcher runs on CUDA tensors, and in Triton's interpreter (``TRITON_INTERPRET=1``)
on CPU tensors for the tests.
"""

# ruff: noqa: ANN001, ANN202
# (Triton reads a kernel's annotations as specialization hints: its arguments are left unannotated.)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpt_fast.kernels.pdl import pdl_launch, wait_for_inputs

BINS = 1 << 16  # one per 16-bit key
STATE = 8  # per row, after its histogram (a workspace zeroed per call): the words below
_BINS = tl.constexpr(BINS)
_ROW = tl.constexpr(BINS + STATE)
_MAX_KEY, _COUNT_TICKET, _KTH, _TAKEN, _TIED, _DRAW_TICKET = (tl.constexpr(i) for i in range(6))
# Logits per program and warps: with PDL 23.2 and 17.9 µs at 32000 and 49152 logits on an H200, where the best of
# five tiles took 20.6 (this tile without PDL) and 16.9 (1024 x 4 warps); at 128256, 51.7 against 49.5 (8192 x 16)
CHUNK = 2048
WARPS = 8
SCAN = 1024  # histogram bins per step of the last program's walk (not tuned)


@triton.jit
def _keys(x):
    """Order-preserving int32 keys in [1, 65536) of 16-bit floats ``x``: 32768 plus or minus the magnitude's bits,
    so that -0 and +0 share one."""
    bits = x.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
    magnitude = bits & 0x7FFF
    return tl.where(bits < 0, 32768 - magnitude, 32768 + magnitude)


@triton.jit
def _chunk_keys(row_logits, start, V, CHUNK: tl.constexpr):
    """Indices [CHUNK] from ``start``, whether each is in the row, the logits there and their keys."""
    offs = start + tl.arange(0, CHUNK)
    valid = offs < V
    x = tl.load(row_logits + offs, mask=valid, other=0.0)
    return offs, valid, x, _keys(x)


@triton.jit
def _kth_key(row_hist, top, K, SCAN: tl.constexpr):
    """Walking the histogram down from the key ``top``: the K-th largest key, the number of keys above it, and
    the number equal to it."""
    start = top
    before = 0  # keys above the bins walked so far
    found = 0
    kth = 0
    above = 0
    tied = 0
    while found == 0:
        bins = start - tl.arange(0, SCAN)  # descending
        count = tl.load(row_hist + bins, mask=bins >= 0, other=0, cache_modifier=".cg")
        through = before + tl.cumsum(count, 0)  # keys at or above each bin
        hit = (through >= K) & (through - count < K)  # true in at most one bin
        found = tl.sum(hit.to(tl.int32), 0)
        kth = tl.sum(tl.where(hit, bins, 0), 0)
        above = tl.sum(tl.where(hit, through - count, 0), 0)
        tied = tl.sum(tl.where(hit, count, 0), 0)
        before += tl.sum(count, 0)
        start -= SCAN
    return kth, above, tied


@triton.jit
def _count(logits, hist, V, K, PROGRAMS, CHUNK: tl.constexpr, SCAN: tl.constexpr, PDL: tl.constexpr):
    """Program (row, c): chunk ``c`` of ``logits[row]`` into the row's histogram; the row's last program stores the
    K-th largest key and its counts in the row's state."""
    row = tl.program_id(0).to(tl.int64)
    row_hist = hist + row * _ROW
    row_state = row_hist + _BINS
    wait_for_inputs(PDL)
    _, valid, _, key = _chunk_keys(logits + row * V, tl.program_id(1) * CHUNK, V, CHUNK)
    tl.atomic_add(row_hist + key, 1, mask=valid, sem="relaxed")
    tl.atomic_max(row_state + _MAX_KEY, tl.max(tl.where(valid, key, 0), 0), sem="relaxed")
    if tl.atomic_add(row_state + _COUNT_TICKET, 1, sem="acq_rel") == PROGRAMS - 1:  # every chunk counted
        top = tl.atomic_add(row_state + _MAX_KEY, 0, sem="acquire")
        kth, above, tied = _kth_key(row_hist, top, K, SCAN)
        tl.store(row_state + _KTH, kth)
        tl.store(row_state + _TAKEN, K - above)
        tl.store(row_state + _TIED, tied)


@triton.jit
def _ties_before(row_logits, chunk, kth, V, CHUNK: tl.constexpr):
    """How many logits of key ``kth`` the chunks before ``chunk`` hold."""
    prior = 0
    for c in range(0, chunk):
        _, valid, _, key = _chunk_keys(row_logits, c * CHUNK, V, CHUNK)
        prior += tl.sum((valid & (key == kth)).to(tl.int32), 0)
    return prior


@triton.jit
def _draw(
    logits,
    noise,
    hist,
    best_score,
    best_index,
    out,
    V,
    PROGRAMS,
    inv_temperature,
    CHUNK: tl.constexpr,
    PROGRAMS_P2: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, c): the best-scored candidate of chunk ``c``; the row's last program stores the row's token
    in ``out[row]``."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    row_hist = hist + row * _ROW
    row_state = row_hist + _BINS
    wait_for_inputs(PDL)
    offs, valid, x, key = _chunk_keys(logits + row * V, chunk * CHUNK, V, CHUNK)
    kth = tl.load(row_state + _KTH)
    taken = tl.load(row_state + _TAKEN)
    is_tied = valid & (key == kth)
    candidate = (valid & (key > kth)) | is_tied
    if taken < tl.load(row_state + _TIED):  # only the lowest-index ties are candidates
        tied = is_tied.to(tl.int32)
        rank = _ties_before(logits + row * V, chunk, kth, V, CHUNK) + tl.cumsum(tied, 0) - tied
        candidate = (valid & (key > kth)) | (is_tied & (rank < taken))
    draw = tl.load(noise + row * V + offs, mask=candidate, other=1.0)
    score = tl.where(candidate, x.to(tl.float32) * inv_temperature - tl.log(draw), -float("inf"))
    best = tl.max(score, 0)
    tl.store(best_score + row * PROGRAMS + chunk, best)
    tl.store(best_index + row * PROGRAMS + chunk, tl.min(tl.where(candidate & (score == best), offs, V), 0))
    if tl.atomic_add(row_state + _DRAW_TICKET, 1, sem="acq_rel") == PROGRAMS - 1:  # every chunk drawn
        slots = tl.arange(0, PROGRAMS_P2)
        scores = tl.load(
            best_score + row * PROGRAMS + slots, mask=slots < PROGRAMS, other=-float("inf"), cache_modifier=".cg"
        )
        index = tl.load(best_index + row * PROGRAMS + slots, mask=slots < PROGRAMS, other=V, cache_modifier=".cg")
        top = tl.max(scores, 0)
        tl.store(out + row, tl.min(tl.where(scores == top, index, V), 0).to(tl.int64))


def top_k_sample(
    logits: torch.Tensor, noise: torch.Tensor, top_k: int, temperature: float, pdl: bool = False
) -> torch.Tensor:
    """Token ids int64 [B] drawn from the ``top_k`` largest of ``logits`` [B, V] (bfloat16 or float16) at
    ``temperature`` > 0 with ``noise`` [B, V] float32 Exp(1) draws: the module's semantics, exactly. ``pdl``:
    launch with programmatic dependent launch where the device has it."""
    rows, vocab = logits.shape
    assert logits.dtype in (torch.bfloat16, torch.float16) and logits.is_contiguous()
    assert noise.shape == logits.shape and noise.dtype == torch.float32 and noise.is_contiguous()
    assert top_k >= 1 and temperature > 0
    programs = triton.cdiv(vocab, CHUNK)
    hist = torch.zeros(rows, BINS + STATE, dtype=torch.int32, device=logits.device)  # [B, BINS + STATE]
    best_score = torch.empty(rows, programs, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(rows, programs, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    launch = pdl_launch(logits.device, pdl)
    grid = (rows, programs)
    _count[grid](logits, hist, vocab, min(top_k, vocab), programs, CHUNK=CHUNK, SCAN=SCAN, num_warps=WARPS, **launch)
    _draw[grid](
        logits,
        noise,
        hist,
        best_score,
        best_index,
        out,
        vocab,
        programs,
        1.0 / temperature,
        CHUNK=CHUNK,
        PROGRAMS_P2=triton.next_power_of_2(programs),
        num_warps=WARPS,
        **launch,
    )
    return out
