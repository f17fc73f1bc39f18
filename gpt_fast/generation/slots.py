"""The two steps of continuous batching over a static KV cache of ``N`` slots (rows): prefill one slot's prompt while
the others wait, and decode the first ``rows`` slots together, each at its own position, with its own sampling
settings and seed.

Every slot's state (its last token, its position, its sampling settings, the log-probabilities of its last step) is
a buffer of :class:`SlotState` with a fixed address, so that the decode step is one CUDA graph in the CUDA-graph
compile modes: its shapes depend only on ``rows``, and a scheduler uses a few values of it (slot 0 alone, or all
slots), each compiled once.

A request held to a constraint (:mod:`gpt_fast.generation.constraint`) needs the mask of its next token, computed
on the host from its last one, before the step that samples it: while any busy slot is constrained the scheduler
runs the *masked* steps (``masked=True``: their own graphs), which apply each slot's mask (``allowed``; all tokens
for the others) and leave the slots marked ``hold`` as they are (their mask is not ready: the step samples for
them, harmlessly, and keeps their token and position). Steps without a constrained slot are the plain ones,
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gpt_fast.generation.decode import COORDINATE_DESCENT, capture_graph, compile_options, tuning_options
from gpt_fast.generation.options import MIN_TEMPERATURE, LogitAdjustments, SamplingConfig
from gpt_fast.generation.sampling import mask_logits, sample_rows
from gpt_fast.model.transformer import Transformer, host_reads_free

TOP_LOGPROBS = 20  # the most alternatives a step reports per token (OpenAI's limit for top_logprobs)
PREFILL_ROWS = 8  # the most prompts one prefill takes (RowPrefills)
PREFILL_TOKENS = 2048  # the most rows × padded length of one prefill of several prompts
MIN_PREFILL_LENGTH = 16  # the shortest padded length


class SlotState(nn.Module):
    """What the steps read and write for each slot, one row per slot."""

    def __init__(self, slots: int, vocab_size: int, device: torch.device | str) -> None:
        super().__init__()
        top = min(TOP_LOGPROBS, vocab_size)

        def buffer(name: str, value: float, *shape: int, dtype: torch.dtype = torch.long) -> None:
            self.register_buffer(name, torch.full((slots, *shape), value, dtype=dtype, device=device), persistent=False)

        buffer("tokens", 0)  # [N]: the slot's last token, the next decode step's input
        buffer("input_pos", 0)  # [N]: that token's position
        buffer("live", False, dtype=torch.bool)  # [N]: the slot holds a sequence that decodes (else it stays put)
        buffer("temperature", 1.0, dtype=torch.float32)  # [N]
        buffer("top_k", vocab_size)  # [N]: the vocabulary size when unlimited
        buffer("top_p", 1.0, dtype=torch.float32)  # [N]
        buffer("keys", 0)  # [N]: the noise key, from the request's seed (sampling.seed_key)
        buffer("logprobs", 0.0, 1 + top, dtype=torch.float32)  # [N, 1 + K]: the last token's, then the K best's
        buffer("top_ids", 0, top)  # [N, K]: the K most likely tokens of the last step
        # LogitAdjustments, per slot: the defaults change nothing
        buffer("presence", 0.0, dtype=torch.float32)  # [N]
        buffer("frequency", 0.0, dtype=torch.float32)  # [N]
        buffer("repetition", 1.0, dtype=torch.float32)  # [N]
        buffer("min_p", 0.0, dtype=torch.float32)  # [N]
        buffer("adjusted", False, dtype=torch.bool)  # [N]: the slot's adjustments change its logits (else skipped)
        buffer("scored", False, dtype=torch.bool)  # [N]: the slot's request reports log-probabilities
        buffer("bias", 0.0, vocab_size, dtype=torch.float32)  # [N, V]
        buffer("counts", 0, vocab_size, dtype=torch.int32)  # [N, V]: each token's count in the answer so far
        buffer("seen", False, vocab_size, dtype=torch.bool)  # [N, V]: in the prompt or the answer
        # constraints, read by the masked steps only: each slot's allowed tokens, one bit each (all by default)
        buffer("allowed", -1, (vocab_size + 31) // 32, dtype=torch.int32)  # [N, W]
        buffer("hold", False, dtype=torch.bool)  # [N]: the slot keeps its token and position this step
        self.vocab_size = vocab_size

    def configure(
        self,
        slot: int,
        sampling: SamplingConfig,
        key: int,
        adjust: LogitAdjustments,
        prompt: torch.Tensor,
        answer: torch.Tensor | None = None,
        scored: bool = True,
    ) -> None:
        """Set a slot's sampling settings and adjustments before its ``prompt`` [T] (token ids on the state's
        device) is prefilled; ``answer`` [A]: the tokens it has generated already (a request resumed after it gave
        its blocks back), which its penalties count; ``scored``: its steps report log-probabilities."""
        self.temperature[slot] = sampling.temperature
        self.top_k[slot] = self.vocab_size if sampling.top_k is None else min(sampling.top_k, self.vocab_size)
        self.top_p[slot] = sampling.top_p
        self.keys[slot] = key
        self.presence[slot], self.frequency[slot] = adjust.presence_penalty, adjust.frequency_penalty
        self.repetition[slot], self.min_p[slot] = adjust.repetition_penalty, adjust.min_p
        self.adjusted[slot], self.scored[slot] = adjust != LogitAdjustments(), scored
        self.bias[slot] = 0.0
        if adjust.logit_bias:
            tokens, biases = zip(*adjust.logit_bias, strict=True)
            self.bias[slot, list(tokens)] = torch.tensor(biases, device=self.bias.device)
        self.counts[slot] = 0
        self.seen[slot] = False
        self.seen[slot, prompt] = True
        if answer is not None:
            self.counts[slot].index_add_(0, answer, torch.ones_like(answer, dtype=torch.int32))
            self.seen[slot, answer] = True
        self.allowed[slot] = -1
        self.hold[slot] = False


def adjusted_logits(state: SlotState, rows: slice, logits: torch.Tensor) -> torch.Tensor:
    """The logits [n, V] of slots ``rows`` as their requests' :class:`LogitAdjustments` change them (min-p aside),
    float32."""
    scores = logits.float() + state.bias[rows]
    repetition = state.repetition[rows, None]
    penalized = torch.where(scores > 0, scores / repetition, scores * repetition)
    scores = torch.where(state.seen[rows], penalized, scores)
    counts = state.counts[rows].float()
    return scores - state.frequency[rows, None] * counts - state.presence[rows, None] * (counts > 0).float()


def min_p_filter(state: SlotState, rows: slice, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` [n, V] without the tokens whose probability after temperature is below ``min_p`` times the most
    likely token's: (s - max) / temperature < log(min_p)."""
    temperature = state.temperature[rows, None].clamp_min(MIN_TEMPERATURE)
    relative = (scores - scores.amax(dim=-1, keepdim=True)) / temperature
    return scores.masked_fill(relative < state.min_p[rows, None].log(), float("-inf"))


def sample_into(
    state: SlotState, rows: slice, logits: torch.Tensor, positions: torch.Tensor, masked: bool = False
) -> None:
    """Sample the next token of the slots ``rows`` from their ``logits`` [n, V] as their requests adjust them
    (:func:`adjusted_logits`, :func:`min_p_filter`), for ``positions`` [n], into the state, with the model's
    log-probabilities (before any adjustment, temperature and filtering) of it and of the K best tokens. ``masked``:
    among the tokens each slot's constraint allows, the slots marked ``hold`` keeping their token (uncounted).

    Eager steps on the CPU, where reading the state costs the host nothing, skip the adjustments where no slot of
    ``rows`` has any and the log-probabilities where none reports them: passes over every row's whole vocabulary,
    which otherwise took 10 % of a step of the default model in `gpt-fast serve` (docs/bench/HISTORY.md,
    2026-11-30k)."""
    eager = host_reads_free(logits)
    adjusts = masked or not eager or bool(state.adjusted[rows].any())
    scores = adjusted_logits(state, rows, logits) if adjusts else logits
    if masked:
        scores = mask_logits(scores, state.allowed[rows])
    if adjusts:
        scores = min_p_filter(state, rows, scores)  # [n, V]
    tokens = sample_rows(
        scores, state.temperature[rows], state.top_k[rows], state.top_p[rows], state.keys[rows], positions, not eager
    )  # [n]
    took = torch.ones_like(tokens[:, None], dtype=torch.int32)  # [n, 1]
    if masked:
        tokens = torch.where(state.hold[rows], state.tokens[rows], tokens)
        took = (~state.hold[rows, None]).int()
    state.counts[rows].scatter_add_(1, tokens[:, None], took)
    state.seen[rows].scatter_(1, tokens[:, None], True)
    state.tokens[rows] = tokens
    if not eager or bool(state.scored[rows].any()):
        logprobs = logits.float().log_softmax(dim=-1)  # [n, V]
        best, best_ids = logprobs.topk(state.top_ids.shape[1], dim=-1)  # [n, K]
        state.logprobs[rows] = torch.cat((logprobs.gather(1, tokens[:, None]), best), dim=1)
        state.top_ids[rows] = best_ids


def prefill_slot(model: Transformer, state: SlotState, slot: int, idx: torch.Tensor, masked: bool = False) -> None:
    """Run the prompt ``idx`` [1, T] through the model into the cache row of ``slot`` and sample its first token
    (``masked``: among those the slot's constraint allows); the other slots are left as they are."""
    _prefill(model, state, slot, idx, last_only=True, masked=masked)


def _prefill(
    model: Transformer, state: SlotState, slot: int, idx: torch.Tensor, *, last_only: bool, masked: bool = False
) -> torch.Tensor:
    """:func:`prefill_slot`'s work; the logits [1, T, V] ([1, 1, V] with ``last_only``)."""
    length = idx.shape[1]
    positions = torch.arange(length, device=idx.device)
    logits = model(idx, positions, last_only=last_only, first_row=slot, from_start=True)
    state.input_pos[slot], state.live[slot] = length, True
    sample_into(state, slice(slot, slot + 1), logits[:, -1], state.input_pos[slot : slot + 1], masked)
    return logits


def extend_slot(
    model: Transformer, state: SlotState, slot: int, idx: torch.Tensor, positions: torch.Tensor, masked: bool = False
) -> None:
    """:func:`prefill_slot` for the rest of a prompt ``idx`` [1, T] at ``positions`` [T] (consecutive, from the
    first position whose keys and values are not in the slot's cache yet: a prompt whose first blocks were
    found in a paged cache's prefix cache), attending to the positions before it through the cache. Eager."""
    logits = model(idx, positions, last_only=True, first_row=slot)  # [1, 1, V]
    state.input_pos[slot], state.live[slot] = positions[-1] + 1, True
    sample_into(state, slice(slot, slot + 1), logits[:, -1], state.input_pos[slot : slot + 1], masked)


def prefill_rows(
    model: Transformer,
    state: SlotState,
    first_row: int,
    idx: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
) -> None:
    """:func:`extend_slot` of several prompts at once, into the rows ``first_row`` onwards (of the cache and of
    ``state``): row ``i`` holds ``length[i]`` tokens of ``idx`` [K, P] (the rest padding) for positions
    ``start[i]`` onwards (``start``, ``length`` [K], device tensors, so that one CUDA graph serves every prompt
    padded to P). The padding's keys and values land after the prompt, in its own blocks or the sink, where each
    decode step writes its position's before attending to it, so nothing reads them; its row's first
    ``start[i] + P`` positions must be in the cache."""
    rows = slice(first_row, first_row + idx.shape[0])
    positions = start[:, None] + torch.arange(idx.shape[1], device=idx.device)  # [K, P]
    logits = model(idx, positions, first_row=first_row, last_index=length - 1)  # [K, 1, V]
    following = start + length  # [K]
    state.input_pos[rows], state.live[rows] = following, True
    sample_into(state, rows, logits[:, -1], following)


def move_rows(state: SlotState, first_row: int, slots: torch.Tensor) -> None:
    """Copy every buffer's rows ``first_row`` onwards into the rows ``slots`` [n] (a device tensor)."""
    for buffer in state.buffers():
        buffer.index_copy_(0, slots, buffer[first_row : first_row + slots.shape[0]].clone())  # no overlap


def score_slot(
    model: Transformer, state: SlotState, slot: int, idx: torch.Tensor, top: int, masked: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`prefill_slot`, and the model's log-probability of each prompt token after the ones before it:
    ``idx[0, 1:]``'s [T - 1], with the ``top`` most likely tokens at each of those positions, log-probabilities
    [T - 1, top] and ids [T - 1, top]. Eager: the logits of every position [1, T, V] are kept for this."""
    logits = _prefill(model, state, slot, idx, last_only=False, masked=masked)  # [1, T, V]
    logprobs = logits[0, :-1].float().log_softmax(dim=-1)  # [T - 1, V]
    chosen = logprobs.gather(1, idx[0, 1:, None])[:, 0]  # [T - 1]
    best, best_ids = logprobs.topk(top, dim=-1)  # [T - 1, top]
    return chosen, best, best_ids


def decode_slots(model: Transformer, state: SlotState, rows: int, masked: bool = False) -> None:
    """One decode step of slots ``0 .. rows - 1``, entirely on the device: each slot's last token goes in at its
    position, the next one is sampled, and the position advances (``masked``: each slot held to its constraint,
    those marked ``hold`` kept as they are). A slot that is not ``live`` decodes too, harmlessly, and keeps its
    position (0 for a free slot, so that its attention reads one position); positions stop at the cache's end, so
    that no slot ever writes outside it."""
    positions = state.input_pos[:rows]  # [n]
    logits = model(state.tokens[:rows, None], positions[:, None])  # [n, 1, V]
    following = positions + 1
    sample_into(state, slice(0, rows), logits[:, -1], following, masked)
    moves = state.live[:rows] & ~state.hold[:rows] if masked else state.live[:rows]  # [n]
    state.input_pos[:rows] = torch.where(moves, following.clamp(max=model.max_seq_length - 1), positions)


@dataclass(frozen=True)
class RowPrefill:
    """One prompt of a prefill of several (:class:`RowPrefills`): its tokens still to compute, and the position of
    the first (the tokens before it are in its blocks already)."""

    tokens: Sequence[int]
    start: int


def prefill_shape(prompts: int, longest: int) -> tuple[int, int] | None:
    """The padded shape (rows, length) of a prefill of ``prompts`` prompts whose longest has ``longest`` tokens to
    compute, each rounded up to a power of two so that a few CUDA graphs serve all; None past :data:`PREFILL_ROWS`
    rows or :data:`PREFILL_TOKENS` tokens."""
    rows = 1 << (prompts - 1).bit_length()
    length = max(MIN_PREFILL_LENGTH, 1 << (longest - 1).bit_length())
    return (rows, length) if rows <= PREFILL_ROWS and rows * length <= PREFILL_TOKENS else None


def prefill_shapes(max_seq_length: int) -> list[tuple[int, int]]:
    """Every shape :func:`prefill_shape` gives whose length a cache of ``max_seq_length`` positions holds."""
    rows = [1 << i for i in range(PREFILL_ROWS.bit_length())]
    lengths = [1 << i for i in range(MIN_PREFILL_LENGTH.bit_length() - 1, PREFILL_TOKENS.bit_length())]
    shapes = [(r, n) for r in rows for n in lengths if prefill_shape(r, n) == (r, n)]
    return [(r, n) for r, n in shapes if n <= max_seq_length]


def padded_inputs(prompts: Sequence[RowPrefill], rows: int, length: int) -> torch.Tensor:
    """:meth:`RowPrefills.run`'s inputs [rows, length + 2] in host memory: each prompt's tokens padded with zeros,
    then its start and its length; the rows past the prompts, padding rows of one token at position 0."""
    inputs = [[*p.tokens, *[0] * (length - len(p.tokens)), p.start, len(p.tokens)] for p in prompts]
    inputs += [[0] * (length + 1) + [1]] * (rows - len(prompts))
    return torch.tensor(inputs, dtype=torch.long)


class RowPrefills:
    """:func:`prefill_rows` of up to :data:`PREFILL_ROWS` prompts at once into ``model``'s cache rows and ``state``'s
    rows ``first_row`` onwards, padded to a :func:`prefill_shape`; with ``graphs`` (a CUDA device), replayed from a
    CUDA graph per shape, captured at its first use (or :meth:`warm_up`).

    Why: an eager prefill launches every kernel from Python, about 25 ms on an H200 for a short prompt whatever the
    model (:class:`gpt_fast.generation.decode.GraphedPrefill`), so requests arriving together waited for one
    another's prefills in turn; one replay prefills them all, and a prompt that the prefix cache mostly holds costs
    about one decode step's reading of the weights. The caller gives the cache rows the prompts' blocks first (the
    rows past the prompts: the sink's), and moves the rows' state to the prompts' slots after (:func:`move_rows`).
    """

    def __init__(self, model: Transformer, state: SlotState, first_row: int, graphs: bool) -> None:
        self.model, self.state, self.first_row, self.use_graphs = model, state, first_row, graphs
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: tuple[int, int] | None = None  # one memory pool: the graphs never run at the same time

    def __call__(self, prompts: Sequence[RowPrefill]) -> None:
        shape = prefill_shape(len(prompts), max(len(p.tokens) for p in prompts))
        assert shape is not None, "more prompts or tokens than one prefill takes"
        self.run(padded_inputs(prompts, *shape))

    def warm_up(self) -> None:
        """Capture every shape's graph that the cache holds (with ``graphs``; else nothing): padding rows alone, in
        the sink."""
        for rows, length in prefill_shapes(self.model.max_seq_length) if self.use_graphs else ():
            self.run(padded_inputs((), rows, length))

    def run(self, inputs: torch.Tensor) -> None:
        """Prefill ``inputs`` [K, P + 2] (host memory): each row's padded tokens, then its start and length."""
        key = (inputs.shape[0], inputs.shape[1] - 2)
        if not self.use_graphs:
            self._prefill(inputs.to(self.state.tokens.device))
            return
        if key not in self.graphs:
            self.graphs[key] = self._capture(inputs)
        graph, static = self.graphs[key]
        static.copy_(inputs, non_blocking=True)  # from pageable memory: staged at once
        graph.replay()

    def _prefill(self, inputs: torch.Tensor) -> None:
        length = inputs.shape[1] - 2
        idx, start, count = inputs[:, :length], inputs[:, length], inputs[:, length + 1]
        prefill_rows(self.model, self.state, self.first_row, idx, start, count)

    def _capture(self, inputs: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        device = self.state.tokens.device
        static = inputs.to(device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return capture_graph(lambda: self._prefill(static), device, self.pool), static


@dataclass(frozen=True)
class SlotSteps:
    """The two steps, compiled or not; each takes ``masked`` last (:func:`decode_slots`). ``graphs``: the decode
    steps replay CUDA graphs (so may the prefills of several prompts, :class:`RowPrefills`)."""

    prefill: Callable[..., None]
    decode: Callable[..., None]
    mode: str
    graphs: bool = False


def make_slot_steps(
    mode: str, compile_prefill: bool = False, tuning: str = COORDINATE_DESCENT, *, exact: bool = False
) -> SlotSteps:
    """The steps for a compile mode (``none`` = eager). The decode step is compiled whole and specialized on
    ``rows`` (``dynamic=False``): each value is its own graph with fixed shapes. A compiled prefill takes any prompt
    length (the length dimension is marked dynamic), as the single-stream one does. ``exact``: with eager rounding
    (:func:`gpt_fast.generation.decode.compile_options`), as the engine's other steps."""
    if mode == "none":
        return SlotSteps(prefill_slot, decode_slots, mode)
    options = compile_options(mode, tuning, exact=exact)
    graphs = bool(options.get("triton.cudagraphs"))
    decode = torch.compile(decode_slots, options=options, fullgraph=True, dynamic=False)
    prefill = prefill_slot
    if compile_prefill:
        compiled = torch.compile(prefill_slot, fullgraph=True, options=tuning_options(tuning))

        def prefill(model: Transformer, state: SlotState, slot: int, idx: torch.Tensor, masked: bool = False) -> None:
            torch._dynamo.maybe_mark_dynamic(idx, 1)
            compiled(model, state, slot, idx, masked)

    return SlotSteps(prefill, decode, mode, graphs)
