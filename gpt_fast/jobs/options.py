"""The options of `gpt-fast generate`, `gpt-fast eval` and `gpt-fast lm-eval`, checked once as they are made.
Imports no torch: the command line checks its arguments before it loads anything."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gpt_fast.generation.options import OutputConstraint, SamplingConfig
from gpt_fast.util.choices import (
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NUM_SAMPLES,
    DEFAULT_PROMPT,
    EVAL_DATASETS,
    EVAL_MAX_TOKENS,
    EVAL_WINDOW,
)
from gpt_fast.util.fileio import check_output_file, trace_file

MAX_SEED = 2**64 - 1
DEFAULT_TEXT = "pydoc_data.topics"
DATASETS = EVAL_DATASETS


@dataclass(frozen=True)
class GenerateOptions:
    """Everything `gpt-fast generate` takes besides the checkpoint and the engine options; the command's defaults
    are these. Checked here, once, before any checkpoint is read."""

    prompt: str = DEFAULT_PROMPT
    prompts: tuple[str, ...] = ()  # two or more prompts generated together (continuous batching) instead of prompt
    chat: bool = False
    system: str | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    num_samples: int = DEFAULT_NUM_SAMPLES
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    profile: str | None = None  # a trace file, or a folder for trace.json
    profile_all_ranks: bool = False  # with tensor parallelism: every rank writes its trace (PATH_rankN.json)
    batch_size: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    metrics_json: Path | None = None  # "-": standard output
    stream: bool = True
    constraint: OutputConstraint | None = None  # what every answer must match (--json_schema)

    def __post_init__(self) -> None:
        if not all(self.all_prompts):
            raise ValueError("--prompt is empty")
        if len(self.prompts) == 1:
            raise ValueError("prompts holds two or more prompts (one goes in prompt)")
        if self.prompts and self.batch_size != 1:
            raise ValueError("--batch_size copies one prompt; several prompts are each generated once, together")
        if self.system is not None and not self.chat:
            raise ValueError("--system goes with --chat (a system message is part of a chat)")
        for name in ("max_new_tokens", "num_samples", "batch_size"):
            check_at_least_one(name, getattr(self, name))
        check_seed(self.seed)
        if self.metrics_json is not None:
            check_output_file(self.metrics_json, "--metrics_json")
        if self.profile is not None:
            if not os.fspath(self.profile):
                raise ValueError("--profile is empty: give a trace file or a folder")
            trace_file(self.profile)
        elif self.profile_all_ranks:
            raise ValueError("--profile_all_ranks goes with --profile")

    @property
    def all_prompts(self) -> tuple[str, ...]:
        return self.prompts or (self.prompt,)

    @property
    def trace_path(self) -> Path | None:
        return trace_file(self.profile) if self.profile else None

    def rank_trace_path(self, rank: int) -> Path | None:
        """Where rank ``rank`` writes its trace: rank 0 at ``--profile``'s path, the others only with
        ``--profile_all_ranks``, each at ``PATH_rankN.json`` (``trace_rankN.json`` in a folder)."""
        if self.profile is None or rank == 0:
            return self.trace_path
        return trace_file(self.profile, f"trace_rank{rank}", f"rank{rank}") if self.profile_all_ranks else None


def check_at_least_one(name: str, value: int) -> None:
    """The flag ``--NAME`` of a count."""
    if value < 1:
        raise ValueError(f"--{name} must be >= 1, got {value}")


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ValueError(f"--seed must be in 0..2**64-1, got {seed}")


@dataclass(frozen=True)
class EvalOptions:
    """What `gpt-fast eval` scores and how; checked when made."""

    text: Path | None = None  # None: the default text (or the dataset)
    dataset: str | None = None
    max_tokens: int = EVAL_MAX_TOKENS
    window: int | None = None  # None: the model's context, at most EVAL_WINDOW; never beyond the context
    stride: int | None = None  # None: half the window

    def __post_init__(self) -> None:
        if self.text is not None and self.dataset is not None:
            raise ValueError("give --text or --dataset, not both")
        if self.dataset is not None and self.dataset not in DATASETS:
            raise ValueError(f"--dataset {self.dataset!r} is not one of {', '.join(DATASETS)}")
        if self.max_tokens < 2:
            raise ValueError(f"--max_tokens must be >= 2, got {self.max_tokens}")
        if self.window is not None and self.window < 2:
            raise ValueError(f"--window must be >= 2, got {self.window}")
        if self.stride is not None and self.window is not None and not 1 <= self.stride <= self.window:
            raise ValueError(f"--stride must be in 1..--window ({self.window}), got {self.stride}")
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"--stride must be >= 1, got {self.stride}")

    def spans(self, context: int) -> tuple[int, int]:
        """``(window, stride)`` for a model of ``context`` tokens: a window beyond it is refused, not shortened
        (the perplexity would be another's than the one asked for)."""
        if self.window is not None and self.window > context:
            raise ValueError(f"--window {self.window} is beyond the model's context of {context} tokens")
        window = self.window if self.window is not None else min(EVAL_WINDOW, context)
        stride = self.stride if self.stride is not None else max(window // 2, 1)
        if stride > window:
            raise ValueError(f"--stride must be in 1..--window ({window}), got {stride}")
        return window, stride

    @property
    def text_name(self) -> str:
        return str(self.text) if self.text is not None else self.dataset or DEFAULT_TEXT


@dataclass(frozen=True)
class LmEvalOptions:
    """What `gpt-fast lm-eval` runs and where its results go; checked when made, before lm-eval or the weights are
    loaded."""

    tasks: tuple[str, ...]
    include_path: Path | None = None  # a folder of task YAMLs, looked up before lm-eval's own tasks
    num_fewshot: int | None = None  # None: each task's own
    limit: float | None = None  # documents per task: a count, or a fraction below 1
    output_path: Path | None = None  # the results as JSON

    def __post_init__(self) -> None:
        if not self.tasks or not all(self.tasks):
            raise ValueError("--tasks needs task names, separated by commas")
        if self.include_path is not None and not self.include_path.is_dir():
            raise ValueError(f"--include_path {self.include_path} is not a folder")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"--num_fewshot must be >= 0, got {self.num_fewshot}")
        if self.limit is not None and not (0 < self.limit < 1 or (self.limit >= 1 and self.limit == int(self.limit))):
            raise ValueError(f"--limit must be a whole number of documents or a fraction in (0, 1), got {self.limit}")
        if self.output_path is not None:
            check_output_file(self.output_path, "--output_path")

    @property
    def limit_value(self) -> int | float | None:
        """``limit`` as lm-eval reads it: a count as an integer, a fraction as a float."""
        return int(self.limit) if self.limit is not None and self.limit >= 1 else self.limit
