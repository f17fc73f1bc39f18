"""The options of generation, as values checked once: what a request samples with (:class:`SamplingConfig`:
temperature, top-k, top-p; a batched request's :class:`LogitAdjustments`), what its answer must match
(:class:`OutputConstraint`) and speculative decoding (:class:`SpeculativeOptions`). Imports no torch, so that the
command line checks them before loading anything (:mod:`gpt_fast.generation.sampling`,
:mod:`gpt_fast.generation.constraint` and :mod:`gpt_fast.generation.speculative` use them)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpt_fast.util.choices import DEFAULT_SPECULATE_K
from gpt_fast.util.options import OptionError

# Below this temperature sampling is greedy: the limit of the distribution as the temperature goes to 0, and dividing
# the logits by an ever smaller number would overflow to infinities (and NaN probabilities).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.8  # 0 (or below MIN_TEMPERATURE) = greedy argmax
    top_k: int | None = 200  # None = the whole vocabulary
    top_p: float = 1.0  # 1 = no nucleus filtering
    # Whether top-p filters: a plain bool, because torch.compile may treat the floats above as symbolic values,
    # and the branches below must not depend on those.
    nucleus: bool = field(init=False)

    def __post_init__(self) -> None:
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ValueError(f"top_k must be an integer >= 1, got {self.top_k}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "nucleus", self.top_p < 1)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties is -2..2
MAX_BIAS = 100.0  # and for a logit bias, -100..100
MAX_BIASED = 300  # tokens a request may bias


@dataclass(frozen=True)
class LogitAdjustments:
    """What a batched request changes in its logits before sampling, in this order: ``logit_bias`` added to the
    tokens it names; ``repetition_penalty`` (transformers' and vLLM's: a token already in the prompt or the answer
    has its logit divided by it where positive, multiplied where negative); then OpenAI's ``frequency_penalty``
    times the number of times a token was generated so far and ``presence_penalty`` once it has been; and
    ``min_p`` (after temperature) drops the tokens less likely than that fraction of the most likely one. The
    defaults change nothing; the log-probabilities reported stay the model's own."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            _require_number(getattr(self, name), name, -MAX_PENALTY, MAX_PENALTY)
        _require_number(self.repetition_penalty, "repetition_penalty", 0.0, math.inf, low_open=True)
        _require_number(self.min_p, "min_p", 0.0, 1.0)
        if len(self.logit_bias) > MAX_BIASED:
            raise ValueError(f"logit_bias names at most {MAX_BIASED} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias token ids must be integers >= 0, got {token!r}")
            _require_number(bias, "a logit_bias value", -MAX_BIAS, MAX_BIAS)


def _require_number(value: object, name: str, low: float, high: float, *, low_open: bool = False) -> None:
    in_range = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (low < value if low_open else low <= value)
        and value <= high
    )
    if not in_range:
        bounds = f"{'above' if low_open else 'from'} {low:g}" + ("" if math.isinf(high) else f" to {high:g}")
        raise ValueError(f"{name} must be a number {bounds}, got {value!r}")


# A schema's bounds, OpenAI's for strict schemas where it has one: properties and enum values in all, the enum values'
# characters in all; and ours: the schema's nesting (JSON levels) and size, and a grammar's size.
MAX_PROPERTIES = 5000
MAX_ENUM_VALUES = 1000
MAX_ENUM_CHARS = 15_000
MAX_SCHEMA_DEPTH = 64
MAX_CONSTRAINT_CHARS = 1 << 18
JSON_OBJECT = '{"type": "object"}'  # OpenAI's json_object: any JSON object


@dataclass(frozen=True)
class OutputConstraint:
    """What a request's answer must be, held to it token by token by the grammar engine
    (:mod:`gpt_fast.generation.constraint`): one JSON document matching ``json_schema`` (a JSON Schema as JSON
    text; :data:`JSON_OBJECT` for any object), or text of ``grammar`` (a Lark grammar as llguidance reads it, which
    may embed JSON schemas: what tool calls are held to). Checked here: one of the two, its size, and a schema's
    nesting, properties and enum values (:data:`MAX_PROPERTIES` and the others); whether a schema is JSON Schema the
    engine says when it compiles it."""

    json_schema: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json_schema", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise OptionError("an output constraint is a json_schema or a grammar", "json_schema", "grammar")
        text = getattr(self, given[0])
        if not isinstance(text, str) or not text.strip() or len(text) > MAX_CONSTRAINT_CHARS:
            raise OptionError(
                f"{given[0]} must be non-empty text of at most {MAX_CONSTRAINT_CHARS} characters", given[0]
            )
        if self.json_schema is not None:
            check_schema(self.json_schema)

    @classmethod
    def from_schema(cls, schema: Mapping[str, Any]) -> OutputConstraint:
        """The constraint of a JSON Schema given as a dict (a Pydantic model's ``model_json_schema()``, say)."""
        try:
            text = json.dumps(schema, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as err:
            raise OptionError(f"json_schema is not JSON: {err}", "json_schema") from None
        return cls(json_schema=text)

    @classmethod
    def json_object(cls) -> OutputConstraint:
        """Any JSON object (OpenAI's ``response_format`` ``json_object``)."""
        return cls(json_schema=JSON_OBJECT)


@dataclass(frozen=True)
class ToolSpec:
    """A function a model may call: its name and its parameters' JSON Schema (None: any object)."""

    name: str
    parameters: Mapping[str, Any] | None = None


def check_schema(text: str) -> None:
    """OptionError unless ``text`` is a JSON object within the bounds :class:`OutputConstraint` names."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        raise OptionError("json_schema is not JSON (or is nested too deeply)", "json_schema") from None
    if not isinstance(schema, dict):
        raise OptionError("json_schema must be a JSON object (a JSON Schema)", "json_schema")
    properties = enum_values = enum_chars = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise OptionError(f"json_schema is nested deeper than {MAX_SCHEMA_DEPTH} levels", "json_schema")
        if isinstance(value, dict):
            if isinstance(value.get("properties"), dict):
                properties += len(value["properties"])
            if isinstance(value.get("enum"), list):
                enum_values += len(value["enum"])
                enum_chars += sum(len(json.dumps(item)) for item in value["enum"])
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
    bounds = [
        (properties, MAX_PROPERTIES, "properties"),
        (enum_values, MAX_ENUM_VALUES, "enum values"),
        (enum_chars, MAX_ENUM_CHARS, "characters of enum values"),
    ]
    for count, limit, what in bounds:
        if count > limit:
            raise OptionError(f"json_schema has {count} {what}, more than the {limit} allowed", "json_schema")


MAX_SPECULATE_K = 16  # proposals per round; past a handful the verify step stops being as cheap as a decode step
MAX_NGRAM = 16


def check_k(k: int) -> int:
    return _in_range(k, 1, MAX_SPECULATE_K, "k")


def check_ngram(ngram: int) -> int:
    return _in_range(ngram, 1, MAX_NGRAM, "prompt_lookup")


def _in_range(value: int, low: int, high: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise OptionError(f"{name} must be an integer in {low}..{high}, got {value!r}", name)
    return value


@dataclass(frozen=True)
class SpeculativeOptions:
    """Speculative decoding with one drafter: ``draft_checkpoint`` (a smaller model that shares the target's
    tokenizer) or ``prompt_lookup`` (n-grams of up to that many tokens looked up in the prompt and the text so
    far), proposing ``k`` tokens per verify step."""

    draft_checkpoint: str | None = None
    prompt_lookup: int | None = None
    k: int = DEFAULT_SPECULATE_K

    def __post_init__(self) -> None:
        if (self.draft_checkpoint is None) == (self.prompt_lookup is None):
            raise OptionError(
                "speculative decoding takes one drafter: draft_checkpoint or prompt_lookup",
                "draft_checkpoint",
                "prompt_lookup",
            )
        if self.draft_checkpoint is not None and not str(self.draft_checkpoint):
            raise OptionError("draft_checkpoint is empty", "draft_checkpoint")
        check_k(self.k)
        if self.prompt_lookup is not None:
            check_ngram(self.prompt_lookup)

    @classmethod
    def from_flags(
        cls, draft_checkpoint: str | None, prompt_lookup: int | None, k: int | None
    ) -> SpeculativeOptions | None:
        """The options the command-line flags ask for; None without a drafter (and then no ``--speculate_k``)."""
        if draft_checkpoint is None and prompt_lookup is None:
            if k is not None:
                raise ValueError("--speculate_k goes with --draft_checkpoint_path or --prompt_lookup")
            return None
        return cls(draft_checkpoint, prompt_lookup, DEFAULT_SPECULATE_K if k is None else k)
