"""What speculative decoding proposes: ``k`` tokens per round, from a smaller draft model, from the text itself
(prompt lookup: what followed the last few tokens the previous time they occurred), or from a recorded
continuation (replay, for benchmarks).

A drafter writes its proposals into a :class:`SpeculativeState` on the device; the verify step
(:mod:`gpt_fast.generation.speculative`) reads them there. Nothing a drafter does waits for the device: prompt lookup
and replay are tensor operations over the token buffer, and a draft model's steps read their input from the buffer the
previous step wrote, as the plain decode step does. Drafters are modules so that their buffers, like the KV caches, have
fixed addresses that a CUDA graph can capture.

Every drafter's proposals are checked by the target, so a drafter only decides the speed, never the text.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gpt_fast.generation.options import SamplingConfig, check_k, check_ngram
from gpt_fast.generation.sampling import probabilities, sample_weights
from gpt_fast.model.cache import DecodeState
from gpt_fast.model.transformer import Transformer
from gpt_fast.util.device import cudagraph_step_begin


class SpeculativeState(nn.Module):
    """The buffers one round passes along on the device.

    ``drafts`` [B, K]: the proposals. ``probs`` [B, K, V] (only when a draft model samples): the distribution each
    proposal was drawn from, which the verify step needs. ``out`` [B, K + 2]: the round's outcome for the host, the
    K + 1 tokens the verify step wrote and, in the last column, how many of them are new text. ``slot`` and
    ``draft_pos``: where a draft model's next proposal goes, and the position of its next input token.
    """

    def __init__(self, batch_size: int, k: int, vocab_size: int, *, with_probs: bool, device: torch.device) -> None:
        super().__init__()
        self.k, self.vocab_size, self.has_probs = k, vocab_size, with_probs
        self.register_buffer("drafts", torch.zeros((batch_size, k), dtype=torch.long, device=device), persistent=False)
        probs = torch.zeros((batch_size, k, vocab_size if with_probs else 0), dtype=torch.float32, device=device)
        self.register_buffer("probs", probs, persistent=False)
        out = torch.zeros((batch_size, k + 2), dtype=torch.long, device=device)
        self.register_buffer("out", out, persistent=False)
        self.register_buffer("slot", torch.zeros(1, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("draft_pos", torch.zeros(1, dtype=torch.long, device=device), persistent=False)

    def shape(self) -> tuple[int, int, int, bool, torch.device]:
        return self.drafts.shape[0], self.k, self.vocab_size, self.has_probs, self.drafts.device


class Drafter(nn.Module, metaclass=abc.ABCMeta):
    """Proposes ``k`` tokens per round into :attr:`spec`. Subclasses say whether their proposals come with a
    distribution (``samples``: a draft model, under sampling) and implement :meth:`draft`; :meth:`propose`, where
    they have one, runs inside a compiled step."""

    samples = False

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = check_k(k)
        self.spec: SpeculativeState | None = None

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """What drafts, for reports."""

    def setup(
        self, batch_size: int, max_seq_length: int, vocab_size: int, sampling: SamplingConfig, device: torch.device
    ) -> SpeculativeState:
        """Allocate the round's buffers (kept while the shape stays: a CUDA graph keeps their addresses)."""
        shape = (batch_size, self.k, vocab_size, self.samples and not sampling.greedy, device)
        if self.spec is None or self.spec.shape() != shape:
            self.spec = None  # free the old buffers first
            self.spec = SpeculativeState(batch_size, self.k, vocab_size, with_probs=shape[3], device=device)
        return self.spec

    def prefill(self, prompt: torch.Tensor) -> None:
        """See the prompt ``prompt`` [B, T] before the first round (a draft model fills its KV cache)."""

    @abc.abstractmethod
    def draft(self, steps: Any, state: DecodeState, sampling: SamplingConfig) -> None:
        """Write this round's proposals into :attr:`spec`, following the target's tokens and position ``state``,
        with the step functions of ``steps`` (a :class:`gpt_fast.generation.speculative.SpeculativeSteps`)."""


class PromptLookup(Drafter):
    """Proposes the tokens that followed the last ``ngram`` tokens where they occurred before, in the prompt or in
    the text generated so far: the longest earlier match of up to ``ngram`` tokens, the latest of equally long
    ones. Free to compute, and right where the answer copies its input (code edits, quotes)."""

    def __init__(self, ngram: int, k: int) -> None:
        super().__init__(k)
        self.ngram = check_ngram(ngram)

    @property
    def name(self) -> str:
        return f"prompt lookup (n-grams up to {self.ngram})"

    def draft(self, steps: Any, state: DecodeState, sampling: SamplingConfig) -> None:
        cudagraph_step_begin()
        steps.propose(self, state)

    def propose(self, state: DecodeState) -> None:
        self.spec.drafts.copy_(lookup_drafts(state.tokens, state.input_pos, self.ngram, self.k))


def lookup_drafts(tokens: torch.Tensor, input_pos: torch.Tensor, ngram: int, k: int) -> torch.Tensor:
    """Proposals [B, k] after the tokens ``tokens`` [B, S] up to and including position ``input_pos`` [1]: what
    followed the longest (then latest) earlier occurrence of their last 1..``ngram`` tokens. A match that ends
    right before the last token is a repetition, continued periodically; with no match at all, the last token is
    repeated. Only positions up to ``input_pos`` are read (the buffer beyond holds stale tokens)."""
    length, device = tokens.shape[1], tokens.device
    offsets = torch.arange(ngram, device=device)  # [N]: 0 is the last token, 1 the one before, ...
    ends = torch.arange(length, device=device)  # [S]: the last position of an earlier occurrence
    pattern = tokens.index_select(1, (input_pos - offsets).clamp_min(0))  # [B, N]
    starts = ends[:, None] - offsets  # [S, N]: the positions compared with the pattern
    usable = (starts >= 0) & (ends[:, None] < input_pos) & (offsets <= input_pos)  # [S, N]
    same = (tokens[:, starts.clamp_min(0)] == pattern[:, None, :]) & usable  # [B, S, N]
    matched = same.long().cumprod(-1).sum(-1)  # [B, S]: length of the match ending at each position
    score = torch.where(ends < input_pos, matched * length + ends, -1)  # longest first, then latest
    best = score.argmax(-1)  # [B]
    period = input_pos - best  # [B], >= 1: where the copy would run into the last token, it starts over
    follow = best[:, None] + 1 + torch.arange(k, device=device) % period[:, None]  # [B, k], all <= input_pos
    return tokens.gather(1, follow)


class DraftModel(Drafter):
    """A smaller model of the same tokenizer drafts ``k`` tokens, one decode step each, with its own static KV
    cache. Its first step of a round reads two positions, the target's last two tokens: that writes the cache entry
    of the last proposal of a fully accepted round (which the draft never read) and costs a draft step no more than
    one position does. Rejected positions need no rollback: the next round writes over them."""

    samples = True

    def __init__(self, model: Transformer, k: int) -> None:
        super().__init__(k)
        self.model = model

    @property
    def name(self) -> str:
        return "draft model"

    def setup(
        self, batch_size: int, max_seq_length: int, vocab_size: int, sampling: SamplingConfig, device: torch.device
    ) -> SpeculativeState:
        self.model.setup_caches(batch_size, max_seq_length)
        return super().setup(batch_size, max_seq_length, vocab_size, sampling, device)

    def prefill(self, prompt: torch.Tensor) -> None:
        self.model(prompt, torch.arange(prompt.shape[1], device=prompt.device), last_only=True, from_start=True)

    def draft(self, steps: Any, state: DecodeState, sampling: SamplingConfig) -> None:
        cudagraph_step_begin()
        steps.draft_first(self, state, sampling)
        for _ in range(self.k - 1):
            cudagraph_step_begin()
            steps.draft_next(self, sampling)


def draft_first(drafter: DraftModel, state: DecodeState, sampling: SamplingConfig) -> None:
    """A round's first draft step: the target's tokens at ``input_pos - 1`` and ``input_pos`` in, proposal 0 out."""
    spec = drafter.spec
    positions = torch.cat([state.input_pos - 1, state.input_pos])  # [2]
    logits = drafter.model(state.tokens.index_select(1, positions), positions, last_only=True)  # [B, 1, V]
    spec.slot.zero_()
    spec.draft_pos.copy_(state.input_pos + 1)
    keep_proposal(spec, logits[:, -1], sampling)


def draft_next(drafter: DraftModel, sampling: SamplingConfig) -> None:
    """A later draft step: the previous proposal in at ``draft_pos``, the next one out."""
    spec = drafter.spec
    logits = drafter.model(spec.drafts.index_select(1, spec.slot - 1), spec.draft_pos)  # [B, 1, V]
    spec.draft_pos.add_(1)
    keep_proposal(spec, logits[:, -1], sampling)


def keep_proposal(spec: SpeculativeState, logits: torch.Tensor, sampling: SamplingConfig) -> None:
    """Draw a proposal from ``logits`` [B, V] as plain decoding would, and store it (with its distribution when
    sampling) at ``spec.slot``."""
    if sampling.greedy:
        token = logits.argmax(dim=-1)  # [B]
    else:
        probs = probabilities(logits, sampling)  # [B, V]
        token = sample_weights(probs)
        spec.probs.index_copy_(1, spec.slot, probs[:, None])
    spec.drafts.index_copy_(1, spec.slot, token[:, None])
    spec.slot.add_(1)


class Replay(Drafter):
    """For benchmarks only: proposes a recorded sequence (the prompt and the target's own greedy continuation from
    an earlier run), so that under greedy decoding every proposal is accepted and drafting costs nothing: the
    ceiling of the mechanism. With ``agreement`` < 1 each proposal is spoiled with probability 1 - agreement, for
    a chosen acceptance rate; with ``cost`` a draft model also runs its steps each round (its proposals unused),
    so that a round costs what it would with that draft."""

    def __init__(
        self, sequence: Sequence[int], k: int, *, agreement: float = 1.0, cost: DraftModel | None = None
    ) -> None:
        super().__init__(k)
        if not 0 <= agreement <= 1:
            raise ValueError(f"agreement must be in [0, 1], got {agreement}")
        self.sequence, self.agreement, self.cost = list(sequence), agreement, cost
        self.vocab_size = 0
        self.register_buffer("recorded", None, persistent=False)  # [B, S], made by setup()
        self.register_buffer("kept", None, persistent=False)  # [1]: the agreement, as data (no recompilation)

    @property
    def name(self) -> str:
        what = "replay" if self.agreement == 1 else f"replay, {self.agreement:.0%} kept"
        return f"{what} + draft model steps" if self.cost is not None else what

    def setup(
        self, batch_size: int, max_seq_length: int, vocab_size: int, sampling: SamplingConfig, device: torch.device
    ) -> SpeculativeState:
        if self.cost is not None:
            self.cost.setup(batch_size, max_seq_length, vocab_size, sampling, device)
        recorded = torch.zeros(max_seq_length, dtype=torch.long)
        known = self.sequence[:max_seq_length]
        recorded[: len(known)] = torch.tensor(known, dtype=torch.long)
        recorded = recorded.to(device).repeat(batch_size, 1)  # [B, S]
        same = self.recorded is not None and self.recorded.shape == recorded.shape
        if same and self.recorded.device == recorded.device:
            self.recorded.copy_(recorded)  # in place: a CUDA graph holds the buffer's address
        else:
            self.register_buffer("recorded", recorded, persistent=False)
            self.register_buffer("kept", torch.tensor([self.agreement], device=device), persistent=False)
        self.vocab_size = vocab_size
        return super().setup(batch_size, max_seq_length, vocab_size, sampling, device)

    def prefill(self, prompt: torch.Tensor) -> None:
        if self.cost is not None:
            self.cost.prefill(prompt)

    def draft(self, steps: Any, state: DecodeState, sampling: SamplingConfig) -> None:
        if self.cost is not None:
            self.cost.draft(steps, state, sampling)
        cudagraph_step_begin()
        steps.propose(self, state)

    def propose(self, state: DecodeState) -> None:
        last = self.recorded.shape[1] - 1
        index = (state.input_pos + 1 + torch.arange(self.k, device=state.input_pos.device)).clamp_max(last)  # [K]
        drafts = self.recorded.index_select(1, index)  # [B, K]
        spoiled = torch.rand(drafts.shape, device=drafts.device) >= self.kept
        self.spec.drafts.copy_(torch.where(spoiled, (drafts + 1) % self.vocab_size, drafts))


def propose_step(drafter: PromptLookup | Replay, state: DecodeState) -> None:
    """The proposal step of a drafter that computes its proposals from buffers (compiled as one graph)."""
    drafter.propose(state)
