"""Speculative decoding: a drafter proposes k tokens, the target checks them all in one forward over k + 1
positions, keeps the longest prefix it agrees with and adds one token of its own. The output is the target's own:

* greedy: a proposal is kept when it is the target's argmax at its position, so every token written is the argmax
  plain decoding would have produced, token for token;
* sampling (Leviathan et al. 2023, Chen et al. 2023): proposal ``d`` drawn from the draft's distribution ``q`` is kept
  with probability min(1, p(d) / q(d)), where ``p`` is the target's distribution; at the first rejection the token is
  drawn from max(0, p - q) renormalized, and after k kept proposals from ``p``. Each token is then distributed as
  ``p``, the distribution plain decoding samples from, after the same temperature, top-k and top-p (p and q are the
  filtered distributions). A drafter without a distribution (prompt lookup, replay) is a ``q`` that puts all its mass
  on its proposal.

Rows of a batch share one position, so a round keeps the shortest accepted prefix over the rows: with that prefix
each row's tokens are still its own target's (a prefix of a correct sample, cut where the other rows stop, is one).

The round runs on the device from end to end: the proposals, the verify forward (one compiled step, one CUDA graph
in ``reduce-overhead``), the accept rule, the tokens written into the decode state and the position moved past the
kept ones. Rejected positions are not rolled back by copying: the position moves only as far as the kept tokens,
and the next round writes over the KV entries beyond. The host reads each round's outcome back asynchronously, a
round or two behind, and waits only for a round it has run :data:`MAX_ROUNDS_AHEAD` rounds ahead of.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from gpt_fast.generation.decode import (
    CACHE_LENGTH_MULTIPLE,
    COORDINATE_DESCENT,
    Steps,
    cache_length,
    check_request,
    compile_options,
    round_up,
)
from gpt_fast.generation.drafters import (
    Drafter,
    DraftModel,
    PromptLookup,
    SpeculativeState,
    draft_first,
    draft_next,
    propose_step,
)
from gpt_fast.generation.loop import GenerationResult, Mark, Record, decode_rows, profile_mark, prompt_rows
from gpt_fast.generation.metrics import SpeculativeMetrics
from gpt_fast.generation.options import SpeculativeOptions
from gpt_fast.generation.profiling import DRAFT_MARK, VERIFY_MARK
from gpt_fast.generation.sampling import SamplingConfig, probabilities, sample_weights
from gpt_fast.model.config import CheckpointConfig
from gpt_fast.model.transformer import Transformer
from gpt_fast.util.device import cudagraph_step_begin

MAX_ROUNDS_AHEAD = 2  # rounds the host may have started beyond those it has read back


# What must be equal for a draft's token ids to mean what the target's mean: the checkpoints' config.json.
_SHARED_TOKENIZER_FIELDS = ("kind", "bos_id", "add_bos", "special_tokens", "pattern")


def check_draft_config(target: CheckpointConfig, draft: CheckpointConfig, draft_where: Path) -> None:
    """Raise ValueError (one line, naming the draft's config.json and the field) unless the draft checkpoint shares
    the target's tokenizer and vocabulary."""
    where = draft_where / "config.json"
    if draft.model.vocab_size != target.model.vocab_size:
        raise ValueError(
            f"{where}: model.vocab_size {draft.model.vocab_size} differs from the target's "
            f"{target.model.vocab_size}; a draft model must share the target's tokenizer and vocabulary"
        )
    names = {f.name for f in fields(target.tokenizer)}
    for name in _SHARED_TOKENIZER_FIELDS:
        assert name in names, name
        if getattr(draft.tokenizer, name) != getattr(target.tokenizer, name):
            raise ValueError(
                f"{where}: tokenizer.{name} differs from the target's; a draft model must share the target's tokenizer"
            )


def make_drafter(options: SpeculativeOptions, draft_model: Transformer | None) -> Drafter:
    """The drafter ``options`` ask for (``draft_model``: the loaded draft checkpoint, if they name one)."""
    if options.prompt_lookup is not None:
        return PromptLookup(options.prompt_lookup, options.k)
    assert draft_model is not None, "the draft checkpoint is not loaded"
    return DraftModel(draft_model, options.k)


# --- the round on the device ----------------------------------------------------------------------------------------


def verify_step(model: Transformer, spec: SpeculativeState, sampling: SamplingConfig) -> None:
    """The target's forward over its current token and the k proposals at positions ``input_pos`` ..
    ``input_pos + k``, the accept rule, and the decode state moved past the kept tokens: all on the device."""
    state = model.decode_state
    positions = state.input_pos + torch.arange(spec.k + 1, device=state.input_pos.device)  # [K + 1]
    ids = torch.cat([state.tokens.index_select(1, state.input_pos), spec.drafts], dim=1)  # [B, K + 1]
    logits = model(ids, positions)  # [B, K + 1, V]
    if sampling.greedy:
        out, accepted = accept_greedy(logits, spec.drafts)
    else:
        out, accepted = accept_sampled(logits, spec.drafts, spec.probs if spec.has_probs else None, sampling)
    kept = accepted.min()  # the rows share one position
    state.tokens.index_copy_(1, positions + 1, out)  # beyond the kept ones: overwritten by the next round
    state.input_pos.add_(kept + 1)
    spec.out[:, : spec.k + 1] = out
    spec.out[:, spec.k + 1] = kept + 1


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of ``drafts`` [B, K] against the target's ``logits`` [B, K + 1, V]: the tokens to write
    [B, K + 1] (the target's argmax at every position) and how many proposals each row keeps [B]."""
    target = logits.argmax(dim=-1)  # [B, K + 1]
    agree = drafts == target[:, :-1]
    return target, agree.long().cumprod(dim=1).sum(dim=1)


def accept_sampled(
    logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None, sampling: SamplingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of ``drafts`` [B, K] drawn from ``draft_probs`` [B, K, V] (None: the drafter proposes
    without a distribution, all its mass on the proposal) against the target's ``logits`` [B, K + 1, V]. Returns
    the tokens to write [B, K + 1] (the kept proposals, then the token drawn at the first rejection, or after k kept
    proposals the target's own) and how many proposals each row keeps [B]."""
    k = drafts.shape[1]
    p = probabilities(logits, sampling)  # [B, K + 1, V]
    p_at = p[:, :k]  # [B, K, V]: the target's distribution where each proposal stands
    index = drafts[..., None]  # [B, K, 1]
    p_draft = p_at.gather(-1, index).squeeze(-1)  # [B, K]: p(d)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = p_at.scatter(-1, index, 0.0)  # max(0, p - q) for q all on d
    else:
        q_draft = draft_probs.gather(-1, index).squeeze(-1)  # [B, K]: q(d) > 0, as d was drawn from q
        residual = (p_at - draft_probs).clamp_min(0.0)
    keep = torch.rand_like(p_draft) * q_draft < p_draft  # probability min(1, p(d) / q(d))
    accepted = keep.long().cumprod(dim=1).sum(dim=1)  # [B]
    fallback = sample_weights(torch.cat([residual, p[:, k:]], dim=1))  # [B, K + 1]: sample_weights normalizes
    proposed = torch.cat([drafts, fallback[:, k:]], dim=1)  # [B, K + 1]
    position = torch.arange(k + 1, device=drafts.device)
    return torch.where(position < accepted[:, None], proposed, fallback), accepted


@dataclass(frozen=True)
class SpeculativeSteps:
    """The step functions of a round, compiled or not (``make_speculative_steps``)."""

    verify: Callable[..., None]
    propose: Callable[..., None]
    draft_first: Callable[..., None]
    draft_next: Callable[..., None]
    mode: str


def make_speculative_steps(mode: str, tuning: str = COORDINATE_DESCENT, *, exact: bool = False) -> SpeculativeSteps:
    """The round's steps for a compile mode (``none`` = eager). Each has fixed shapes for a fixed k and batch, so
    each compiles whole; ``reduce-overhead`` and ``max-autotune`` capture each as a CUDA graph. ``exact``: with
    eager rounding (:func:`gpt_fast.generation.decode.compile_options`)."""
    functions = (verify_step, propose_step, draft_first, draft_next)
    if mode == "none":
        return SpeculativeSteps(*functions, mode)
    options = compile_options(mode, tuning, exact=exact)
    return SpeculativeSteps(*(torch.compile(f, options=options, fullgraph=True) for f in functions), mode)


# --- the loop on the host -------------------------------------------------------------------------------------------


def speculative_cache_length(prompt_length: int, max_new_tokens: int, k: int, block_size: int) -> int:
    """KV-cache length for a speculative request: the request must fit the context, and the cache holds a few
    rounds more, which the host may start before it has read that the request is done. Those positions may lie
    beyond the model's context: their tokens are dropped."""
    cache_length(prompt_length, max_new_tokens, block_size)
    needed = prompt_length + max_new_tokens + (MAX_ROUNDS_AHEAD + 1) * (k + 1)
    return round_up(needed, CACHE_LENGTH_MULTIPLE)


class RoundTimer:
    """The draft and verify time of every round: CUDA events on a GPU, read once at the end (recording one never
    waits for the device); the host clock on the CPU, whose work is done when each call returns."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.rounds: list[tuple[Any, Any, Any]] = []

    def stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, start: Any, drafted: Any, verified: Any) -> None:
        self.rounds.append((start, drafted, verified))

    def totals(self) -> tuple[float, float]:
        """Seconds of drafting and of verifying over all rounds (once the device has finished them)."""

        def seconds(a: Any, b: Any) -> float:
            return a.elapsed_time(b) / 1e3 if self.cuda else b - a

        return sum(seconds(s, d) for s, d, _ in self.rounds), sum(seconds(d, v) for _, d, v in self.rounds)


@dataclass(frozen=True)
class SpeculativeResult(GenerationResult):
    speculative: SpeculativeMetrics


class SpeculativeRounds:
    """Speculative decoding as a step producer of the one loop (:func:`gpt_fast.generation.loop.decode_rows`): a step
    is a round (its draft phase, then its verify step), whose outcome is read back as one row of
    ``B * (K + 2)`` values (per row K + 1 tokens, then the count of new ones); the prefill's token is read back as a
    round of one token. The host runs at most :data:`MAX_ROUNDS_AHEAD` rounds ahead of those it has read."""

    always_read = True  # a round's token count is known only once it is read back

    def __init__(
        self,
        model: Transformer,
        drafter: Drafter,
        prompt_ids: Sequence[int],
        steps: Steps,
        spec_steps: SpeculativeSteps,
        sampling: SamplingConfig,
        mark: Mark,
    ) -> None:
        self.model, self.drafter, self.steps, self.spec_steps = model, drafter, steps, spec_steps
        self.sampling, self.mark = sampling, mark
        self.spec = drafter.spec
        self.batch_size = self.spec.drafts.shape[0]
        device = model.norm.weight.device
        self.prompt = prompt_rows(prompt_ids, self.batch_size, device)  # [B, T]
        self.timer = RoundTimer(device)
        self.counts: list[int] = []  # new tokens of each round read back, the prefill's first

    def prefill(self) -> None:
        """The target's prefill and the drafter's; the first token is written as a round of one token."""
        self.steps.prefill(self.model, self.prompt, self.sampling)
        self.drafter.prefill(self.prompt)
        self.spec.out[:, 0] = self.model.decode_state.tokens[:, self.prompt.shape[1]]
        self.spec.out[:, -1] = 1

    def step(self) -> None:
        began = self.timer.stamp()
        with self.mark(DRAFT_MARK):
            self.drafter.draft(self.spec_steps, self.model.decode_state, self.sampling)
        drafted = self.timer.stamp()
        with self.mark(VERIFY_MARK):
            cudagraph_step_begin()
            self.spec_steps.verify(self.model, self.spec, self.sampling)
        self.timer.add(began, drafted, self.timer.stamp())

    def latest(self) -> tuple[torch.Tensor]:
        return (self.spec.out.view(-1),)  # [B * (K + 2)]

    def may_run_ahead(self, pending: int, budget_left: int) -> bool:
        return pending < MAX_ROUNDS_AHEAD and pending < budget_left  # each pending round gives at least one token

    def unpack(self, record: Record) -> list[list[int]]:
        (positions,) = unpack_rounds([record.host[0].tolist()], self.batch_size)
        self.counts.append(len(positions))
        return positions

    def all_tokens(self, produced: int) -> list[list[int]]:
        raise AssertionError("speculative rounds are always read back")

    def result(self, tokens: list[list[int]], seconds: float, ttft: float) -> SpeculativeResult:
        return SpeculativeResult(tokens, seconds, ttft, self.metrics())

    def metrics(self) -> SpeculativeMetrics:
        """The figures of every round started (the loop has read them all back)."""
        draft_seconds, verify_seconds = self.timer.totals()
        rounds = len(self.timer.rounds)
        return SpeculativeMetrics.of(
            self.drafter.name,
            self.drafter.k,
            rounds=rounds,
            accepted=sum(self.counts[1:]) - rounds,
            verify_seconds=verify_seconds,
            draft_seconds=draft_seconds,
        )


@torch.no_grad()
def speculative_stream(
    model: Transformer,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    steps: Steps,
    spec_steps: SpeculativeSteps,
    batch_size: int = 1,
    stop_ids: Sequence[int] = (),
    emit: bool = True,
    profile_marks: bool = False,
) -> Generator[list[int], None, SpeculativeResult]:
    """:func:`gpt_fast.generation.decode.generate_stream` with speculative decoding: yields each new position's
    tokens (one per batch row) as the rounds that made them are read back (with ``emit``), and returns a
    :class:`SpeculativeResult`. ``steps`` gives the prefill, ``spec_steps`` the round's steps."""
    check_request(prompt_ids, max_new_tokens)
    device = model.norm.weight.device
    cache = speculative_cache_length(len(prompt_ids), max_new_tokens, drafter.k, model.config.block_size)
    model.setup_caches(batch_size, cache)
    drafter.setup(batch_size, cache, model.config.vocab_size, sampling, device)
    rounds = SpeculativeRounds(model, drafter, prompt_ids, steps, spec_steps, sampling, profile_mark(profile_marks))
    return (
        yield from decode_rows(
            rounds, device, max_new_tokens=max_new_tokens, stop_ids=stop_ids, emit=emit, profile_marks=profile_marks
        )
    )


def unpack_rounds(rounds: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """Each round's new tokens, per position (one per batch row), from its flattened outcome
    [B * (K + 2)]: per row K + 1 tokens then the count of new ones."""
    unpacked = []
    for flat in rounds:
        width = len(flat) // batch_size
        rows = [flat[b * width : (b + 1) * width] for b in range(batch_size)]
        count = rows[0][-1]
        unpacked.append([[row[i] for row in rows] for i in range(count)])
    return unpacked
