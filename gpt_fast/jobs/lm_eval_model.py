"""`gpt-fast lm-eval`: lm-evaluation-harness tasks on a checkpoint, in this process, through the engine.

:class:`GptFastLM` is an lm-evaluation-harness model over an :class:`~gpt_fast.engine.engine.Engine`, tokenizing
as lm-eval's Hugging Face model does, so that a checkpoint scores what the same weights score there:

- a text is encoded with BOS as the checkpoint says (none when it already starts with BOS's text);
- a continuation's tokens are those of the whole text after the context's (the context's trailing white space moves to
  the continuation first), so that a word is tokenized as it is in running text; an empty context is the prefix
  token (BOS, else EOS);
- ``loglikelihood_rolling`` scores a document in windows of the model's context (each window's tokens go through
  the model whole, its last one too: one token less of context than lm-eval's Hugging Face model), each token
  once, with as much context as fits (lm-eval's rolling windows, the prefix token first);
- ``generate_until`` decodes the requests together in the engine's batcher, each with its own stop strings
  (``until``), token budget (``max_gen_toks``) and sampling (greedy unless ``do_sample`` with a temperature).

This module imports ``lm_eval``: only the command imports it, once the extra is known to be installed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lm_eval
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, handle_non_serializable, make_disjoint_window, make_table

from gpt_fast.engine.batcher import MAX_STOP_TEXTS, Event, Finished, Request
from gpt_fast.engine.engine import Engine
from gpt_fast.engine.options import BatchOptions
from gpt_fast.generation.options import SamplingConfig
from gpt_fast.jobs.options import LmEvalOptions
from gpt_fast.util.fileio import write_text_atomic

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's Hugging Face model's budget when a task names none
Write = Callable[[str], None]


class GptFastLM(TemplateLM):
    """lm-evaluation-harness's model interface over an engine whose weights are loaded (see the module's
    docstring). ``max_length``: the tokens of a scored window (default: the model's context)."""

    def __init__(self, engine: Engine, max_length: int | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.max_length = max_length or engine.model_config.block_size
        if not 2 <= self.max_length <= engine.model_config.block_size:
            raise ValueError(f"max_length must be in 2..{engine.model_config.block_size}, got {self.max_length}")

    @property
    def eot_token_id(self) -> int:
        tokenizer = self.engine.tokenizer
        return tokenizer.special_tokens.get(tokenizer.eos_token, self.engine.stop_ids[0])

    @property
    def prefix_token_id(self) -> int:
        bos = self.engine.tokenizer.bos_id
        return self.eot_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return str(self.engine.checkpoint_dir)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string``; with BOS as the checkpoint says unless ``add_special_tokens`` is False or the
        string starts with BOS's text already."""
        tokenizer = self.engine.tokenizer
        if add_special_tokens is None:
            add_special_tokens = not (tokenizer.bos_token and string.startswith(tokenizer.bos_token))
        return tokenizer.encode(string, bos=add_special_tokens)

    def _loglikelihood_tokens(
        self, requests: Sequence[tuple[Any, list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        return [self.score(context, continuation) for _, context, continuation in requests]

    def score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """The log-likelihood of ``continuation`` after ``context`` and whether greedy decoding writes it, from the
        last ``max_length`` tokens of the two (the context is cut on the left, as lm-eval's models do)."""
        if not 1 <= len(continuation) < self.max_length:
            raise ValueError(f"a continuation of {len(continuation)} tokens cannot be scored in {self.max_length}")
        log_likelihoods, greedy = self.engine.token_scores((context + continuation)[-self.max_length :])
        count = len(continuation)
        return log_likelihoods[-count:].double().sum().item(), bool(greedy[-count:].all())

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        return [self.rolling(self.tok_encode(string, add_special_tokens=False)) for (string,) in self.args(requests)]

    def rolling(self, ids: list[int]) -> float:
        """The log-likelihood of a whole document, each token scored once after the prefix token."""
        windows = get_rolling_token_windows(ids, self.prefix_token_id, self.max_length - 1, context_len=1)
        return sum(self.score(*make_disjoint_window(window))[0] for window in windows)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        plans = [self.plan(context, dict(gen_kwargs)) for context, gen_kwargs in self.args(requests)]
        if not plans:
            return []
        texts = self.generate([request for request, _ in plans])
        return [cut_at_stops(text, until) for text, (_, until) in zip(texts, plans, strict=True)]

    def plan(self, context: str, gen_kwargs: dict[str, Any]) -> tuple[Request, list[str]]:
        """The batcher's request for one generation, and its stop strings."""
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else [text for text in until if text]
        budget = int(gen_kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        if not 1 <= budget < self.max_length:
            raise ValueError(f"max_gen_toks {budget} leaves no room for a prompt in {self.max_length} tokens")
        prompt = self.tok_encode(context)[-(self.max_length - budget) :] or [self.prefix_token_id]
        seed = int(torch.randint(2**62, ()).item())  # lm-eval seeds torch: a run repeats
        stops = tuple(until[:MAX_STOP_TEXTS])  # any more are cut from the text afterwards
        return Request(tuple(prompt), budget, sampling_of(gen_kwargs), seed=seed, stop_texts=stops), until

    def generate(self, requests: list[Request]) -> list[str]:
        """The text of every request, decoded in the engine's batcher, as many at once as `gpt-fast serve` decodes
        by default (each slot's cache holds the longest request; more slots would hold more memory)."""
        longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
        options = BatchOptions(min(len(requests), BatchOptions.max_batch), max(longest, 2), len(requests))
        batcher = self.engine.batcher(options)
        finished: dict[int, Finished] = {}
        for row, request in enumerate(requests):

            def keep(event: Event, row: int = row) -> None:
                if isinstance(event, Finished):
                    finished[row] = event

            batcher.submit(request, keep)
        batcher.run()
        return [finished[row].text for row in range(len(requests))]

    @staticmethod
    def args(requests: list[Instance]) -> list[tuple]:
        return [request.args for request in requests]


def sampling_of(gen_kwargs: dict[str, Any]) -> SamplingConfig:
    """Greedy unless ``do_sample`` is set and the temperature (default 1) is above 0, as lm-eval's Hugging Face
    model reads a task's generation arguments; sampling draws from the whole vocabulary unless ``top_k`` or
    ``top_p`` say otherwise."""
    temperature = float(gen_kwargs.get("temperature", 1.0))
    if not gen_kwargs.get("do_sample") or temperature == 0:
        return SamplingConfig(temperature=0.0)
    return SamplingConfig(temperature, gen_kwargs.get("top_k"), float(gen_kwargs.get("top_p", 1.0)))


def cut_at_stops(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first of ``until``: what the batcher stopped at, and any stop string past its limit."""
    for stop in until:
        text = text.split(stop)[0]
    return text


def task_manager(options: LmEvalOptions) -> TaskManager:
    """The tasks of ``--include_path`` alone when they hold every task asked for (lm-eval's own thousands of task
    configs take half a minute to index), else those and lm-eval's. ValueError naming the tasks found nowhere."""
    if options.include_path is not None:
        local = TaskManager(include_path=str(options.include_path), include_defaults=False)
        if not unknown_tasks(local, options.tasks):
            return local
    manager = TaskManager(include_path=None if options.include_path is None else str(options.include_path))
    missing = unknown_tasks(manager, options.tasks)
    if missing:
        where = "lm-eval's tasks" + ("" if options.include_path is None else f" or {options.include_path}")
        raise ValueError(f"--tasks: {', '.join(missing)} not found in {where} (lm-eval ls tasks lists them)")
    return manager


def unknown_tasks(manager: TaskManager, tasks: Sequence[str]) -> list[str]:
    return [task for task in tasks if not manager.match_tasks([task])]


def run_lm_eval(engine: Engine, options: LmEvalOptions, manager: TaskManager, write: Write) -> dict[str, Any]:
    """Load the weights, run the tasks, print lm-eval's tables and write ``--output_path``; the results."""
    engine.load_weights()
    results = lm_eval.simple_evaluate(
        model=GptFastLM(engine),
        tasks=list(options.tasks),
        num_fewshot=options.num_fewshot,
        limit=options.limit_value,
        task_manager=manager,
        log_samples=False,
    )
    facts = {"checkpoint": str(engine.checkpoint_dir), "device": engine.device_name, "dtype": engine.dtype_name}
    write(", ".join(f"{name} {value}" for name, value in facts.items()) + "\n")
    write(make_table(results) + "\n")
    if "groups" in results:
        write(make_table(results, "groups") + "\n")
    if options.output_path is not None:
        text = json.dumps(results | {"gpt_fast": facts}, indent=2, default=handle_non_serializable)
        write_text_atomic(Path(options.output_path), text + "\n")
    return results
