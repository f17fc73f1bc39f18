"""Next-token sampling: greedy, temperature, top-k and top-p, as plain functions of the logits.

Randomness is drawn with the exponential trick (argmax of p / Exp(1) is a sample from p), which needs no host
round-trip and compiles into the decode step. One stream of tokens (:func:`sample`) draws from torch's global
generator, seeded by ``--seed``. Rows decoded together for different requests (:func:`sample_rows`) each have their
own settings and their own noise, a hash of the request's seed and the position drawn for, so that a seeded request
gets the same tokens whatever it is batched with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpt_fast.generation.options import MIN_TEMPERATURE, SamplingConfig
from gpt_fast.model.transformer import host_reads_free

SCAN_BLOCK = 256  # values per block of cumulative_sum's first scan


def cumulative_sum(x: torch.Tensor) -> torch.Tensor:
    """``torch.cumsum`` over the last dimension of ``x`` [..., K], up to rounding, as two short scans: one within
    blocks of :data:`SCAN_BLOCK` values, one over the blocks' totals.

    Why: for a long scan over few rows (the server's [8, 32000] probabilities) inductor (torch 2.11, CUDA) emits a
    "split scan" kernel whose code generation fails; short scans are never split.
    """
    *lead, n = x.shape
    blocks = -(-n // SCAN_BLOCK)
    padded = F.pad(x, (0, blocks * SCAN_BLOCK - n)).reshape(*lead, blocks, SCAN_BLOCK)
    within = padded.cumsum(-1)  # [..., blocks, SCAN_BLOCK]
    totals = within[..., -1]  # [..., blocks]
    before = totals.cumsum(-1) - totals  # [..., blocks]: the sum of the blocks before each
    return (within + before[..., None]).reshape(*lead, blocks * SCAN_BLOCK)[..., :n]


def top_p_filter(sorted_logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) all but the smallest prefix of descending-sorted logits [B, K] whose probability reaches top_p
    (a number, or [B, 1]: one per row)."""
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = cumulative_sum(probs) - probs  # probability of the tokens ranked above each one
    return sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))


def candidates(logits: torch.Tensor, config: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled, filtered logits over the candidate tokens, and the candidates' vocabulary ids (None = all, in order).

    With top-k the candidates are the k best, sorted, so top-p works on k values instead of the whole vocabulary.
    """
    logits = logits.float() / config.temperature  # [B, V]
    index = None
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        # Only top-p needs the candidates in order; sorting them costs a kernel as long as the rest of sampling.
        logits, index = torch.topk(logits, config.top_k, dim=-1, sorted=config.nucleus)  # [B, k]
    elif config.nucleus:
        logits, index = torch.sort(logits, dim=-1, descending=True)
    if config.nucleus:
        logits = top_p_filter(logits, config.top_p)
    return logits, index


# A kernel for top-k sampling: (logits [B, V], noise [B, V] float32 Exp(1) draws, k, temperature) -> token ids
# int64 [B], a sample from the softmax of logits / temperature over the k largest (gpt_fast.accel.top_k).
TopKSampler = Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]
KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # the logits a TopKSampler takes


def sample(logits: torch.Tensor, config: SamplingConfig, top_k_sampler: TopKSampler | None = None) -> torch.Tensor:
    """Next token ids [B] (int64) from the last position's logits [B, V]; with ``top_k_sampler``, top-k sampling
    of 16-bit logits without top-p goes through it (the same distribution; other settings ignore it)."""
    if config.greedy:
        return logits.argmax(dim=-1)
    if top_k_sampler is not None and kernel_samples(logits, config):
        noise = torch.empty_like(logits, dtype=torch.float32).exponential_(1)  # [B, V]
        return top_k_sampler(logits, noise, config.top_k, config.temperature)
    scores, index = candidates(logits, config)
    choice = sample_weights(torch.softmax(scores, dim=-1))  # [B]
    return choice if index is None else index.gather(-1, choice[:, None]).squeeze(-1)


def kernel_samples(logits: torch.Tensor, config: SamplingConfig) -> bool:
    """Whether a :data:`TopKSampler` takes ``logits`` [B, V] under ``config`` (not greedy): 16-bit logits, top-k
    below the vocabulary size, no top-p."""
    top_k = config.top_k
    return logits.dtype in KERNEL_DTYPES and top_k is not None and top_k < logits.shape[-1] and not config.nucleus


MASK32 = 0xFFFFFFFF
_HASH_MULTIPLIER = 0x45D9F3B  # below 2**27: a product with a 32-bit value stays below 2**63, exact in int64
# Bits of a uniform draw: float32 holds each value and the half step above it exactly (24 significant bits), so that
# the draw is strictly inside (0, 1). With 24 bits the largest value plus a half rounded up to 1, whose noise, 0,
# made a token outside top-k (probability 0, so 0 / 0) win the argmax: a few draws in a thousand over 49152 tokens.
_UNIFORM_BITS = 23


def seed_key(seed: int) -> int:
    """A request's seed, any integer, as the 32-bit key of its noise."""
    return int.from_bytes(hashlib.blake2b(str(seed).encode(), digest_size=4).digest(), "little")


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 values below 2**32: on every device the same,
    since no product overflows."""
    x = ((x ^ (x >> 16)) * _HASH_MULTIPLIER) & MASK32
    x = ((x ^ (x >> 16)) * _HASH_MULTIPLIER) & MASK32
    return x ^ (x >> 16)


def token_noise(keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws [B, N] of the token ids ``tokens`` ([B, N], or [1, N] for every row) for each row's token at
    ``positions`` [B], a function of its ``keys`` [B] (from :func:`seed_key`), the position and the token id alone."""
    row = mix32(keys ^ mix32(positions))  # [B]
    bits = mix32(mix32(row[:, None] ^ tokens)) >> (32 - _UNIFORM_BITS)  # [B, N]
    uniform = (bits.float() + 0.5) / 2**_UNIFORM_BITS  # in (0, 1)
    return -uniform.log()


def row_noise(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The draws [B, V] of every token id (:func:`token_noise`)."""
    return token_noise(keys, positions, torch.arange(vocab_size, device=keys.device)[None])


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    fixed_shapes: bool | None = None,
) -> torch.Tensor:
    """Next token ids [B] from logits [B, V], each row with its own ``temperature`` [B] (below MIN_TEMPERATURE:
    greedy), ``top_k`` [B] (the vocabulary size: no limit), ``top_p`` [B] and noise (:func:`token_noise`).

    With ``fixed_shapes`` the shapes never depend on the settings, so that rows of different requests decode in one
    fixed graph: every row's logits are sorted, and top-k and top-p become masks by rank. Eager steps on the CPU
    (``fixed_shapes`` None there), where reading the settings costs the host nothing, take the same tokens by a
    shorter way: rows all greedy need the argmax alone, and rows without top-p only their top-k candidates, where
    sorting SmolLM2's 49152 logits takes 3.5 ms a row on two cores (docs/cpu.md, "Serving")."""
    if fixed_shapes is None:
        fixed_shapes = not host_reads_free(logits)
    greedy = temperature < MIN_TEMPERATURE  # [B]
    if not fixed_shapes and bool(greedy.all()):
        return best_tokens(logits, fixed_shapes)
    scaled = logits.float() / temperature.clamp_min(MIN_TEMPERATURE)[:, None]
    if not fixed_shapes and bool((top_p >= 1).all()):
        ranked, index = scaled.topk(int(top_k.max()), dim=-1)  # [B, k], descending
    else:
        ranked, index = scaled.sort(dim=-1, descending=True)  # [B, V]
    ranked = ranked.masked_fill(torch.arange(index.shape[1], device=logits.device) >= top_k[:, None], float("-inf"))
    ranked = torch.where(top_p[:, None] < 1, top_p_filter(ranked, top_p[:, None]), ranked)
    noise = token_noise(keys, positions, index)  # each token's own draw, in rank order
    choice = torch.argmax(torch.softmax(ranked, dim=-1) / noise, dim=-1, keepdim=True)  # [B, 1]
    return torch.where(greedy, best_tokens(logits, fixed_shapes), index.gather(1, choice).squeeze(1))


def best_tokens(logits: torch.Tensor, fixed_shapes: bool) -> torch.Tensor:
    """Each row's argmax [B] of ``logits`` [B, V]; without ``fixed_shapes`` (an eager step on the CPU) a row at a
    time: over several rows torch shares the argmax among OpenMP's threads, whose spinning or waking then takes the
    core from our kernels' helper threads for milliseconds (docs/cpu.md, "Threads")."""
    if fixed_shapes:
        return logits.argmax(dim=-1)
    return torch.cat([row.argmax(dim=-1) for row in logits.split(1)])


def mask_logits(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, V] with the tokens a constraint does not allow at -inf: ``words`` [B, W] (int32) holds one bit
    per token, token ``32 * j + i`` in bit ``i`` of word ``j`` (:mod:`gpt_fast.generation.constraint`)."""
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = ((words[:, :, None] >> bits) & 1).flatten(1)[:, : logits.shape[-1]]  # [B, V]
    return logits.masked_fill(allowed == 0, float("-inf"))


def sample_weights(weights: torch.Tensor) -> torch.Tensor:
    """An index along the last dimension of ``weights`` [..., N] (non-negative, not necessarily normalized) drawn
    in proportion to them: the exponential trick, argmax of w / Exp(1). Returns int64 [...]."""
    return torch.argmax(weights / torch.empty_like(weights).exponential_(1), dim=-1)


def probabilities(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """The distribution :func:`sample` draws from, over the whole vocabulary: float32 [..., V] for logits
    [..., V], zero outside the top-k / top-p candidates. Not for greedy configs (their distribution is the argmax).

    Speculative sampling needs the draft's and the target's distributions themselves, not only a sample."""
    assert not config.greedy, "greedy sampling has no distribution to speak of: use the argmax"
    scores, index = candidates(logits, config)
    probs = torch.softmax(scores, dim=-1)
    return probs if index is None else torch.zeros_like(logits, dtype=probs.dtype).scatter_(-1, index, probs)
