"""The requests `gpt-fast bench serve` sends (:class:`~gpt_fast.bench.options.ServeBenchOptions`), planned before
a run so that the clients only send them. Imports no torch.

The fixed workload is one prompt text (its client and request numbered in it) and ``max_tokens`` per answer. The
mixed one draws each request's prompt and answer lengths uniformly from their ranges, and its prompt as random
token ids after the shared system prompt; every draw comes from ``seed`` (Python's :class:`random.Random`, seeded
with a string naming what it draws, so that a run's requests do not depend on which runs came before it)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from gpt_fast.bench.options import ServeBenchOptions
from gpt_fast.model.shapes import get_shape

FIXED_PROMPT = "def quicksort(arr):\n    # sort the list in place, client {client:02d}, round {round:02d}\n"
WARM_UP_ROUND = 99  # the fixed prompt's round number in a warm-up request


@dataclass(frozen=True)
class Planned:
    """One request: its prompt (text, or token ids) and the tokens its answer runs to (``ignore_eos``)."""

    prompt: str | tuple[int, ...]
    answer_tokens: int


def fixed_prompt(client: int, round_index: int) -> str:
    return FIXED_PROMPT.format(client=client, round=round_index)


def system_prompt(options: ServeBenchOptions) -> tuple[int, ...]:
    """The ``system_prompt_tokens`` ids in front of every mixed prompt: the same for every request of every run."""
    draw = random.Random(f"{options.seed}:system prompt")
    vocab = get_shape(options.shape).vocab_size
    return tuple(draw.randrange(vocab) for _ in range(options.system_prompt_tokens))


def plan(options: ServeBenchOptions, clients: int, warm_up: bool = False) -> list[list[Planned]]:
    """Each of ``clients`` clients' requests, in the order it sends them: ``rounds`` of them, or one to warm up."""
    requests = 1 if warm_up else options.rounds
    if options.workload == "fixed":
        rounds = [WARM_UP_ROUND] if warm_up else range(requests)
        return [[Planned(fixed_prompt(c, r), options.max_tokens) for r in rounds] for c in range(clients)]
    draw = random.Random(f"{options.seed}:{clients} clients{', warm-up' if warm_up else ''}")
    prefix = system_prompt(options)
    vocab = get_shape(options.shape).vocab_size

    def mixed() -> Planned:
        length = draw.randint(*options.prompt_tokens)
        answer = draw.randint(*options.answer_tokens)
        return Planned(prefix + tuple(draw.randrange(vocab) for _ in range(length)), answer)

    return [[mixed() for _ in range(requests)] for _ in range(clients)]


def longest_prompt(options: ServeBenchOptions) -> int:
    """The most tokens a planned prompt holds (the fixed prompt with the largest numbers in it: its bytes, as the
    byte-level tokenizer encodes them, and BOS)."""
    if options.workload == "fixed":
        last_round = max(options.rounds - 1, WARM_UP_ROUND)
        return len(fixed_prompt(max(options.counts) - 1, last_round).encode()) + 1
    return options.system_prompt_tokens + options.prompt_tokens[1]


def longest_answer(options: ServeBenchOptions) -> int:
    return options.max_tokens if options.workload == "fixed" else options.answer_tokens[1]
