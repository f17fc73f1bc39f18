"""Structured output: an answer held to a JSON schema or a grammar, token by token, by llguidance.

:class:`Grammars` reads a tokenizer's vocabulary once (each token's bytes, :attr:`Tokenizer.token_bytes`; special
tokens are never text) and compiles a request's :class:`~gpt_fast.generation.options.OutputConstraint` into a
:class:`Matcher`, with its first mask, so that a schema the engine refuses, or one past its bounds on its work
(llguidance's limits: its time-out) at the first token, is refused before anything is generated; one it gives up on
later fails then (:class:`GrammarError` either way). The matcher advances on the host by each token read back, and
writes the mask of the next one, one bit per token of the vocabulary in int32 words [W], which the step that samples
that token applies to its logits (:func:`gpt_fast.generation.sampling.mask_logits`).

Why llguidance (``scripts/grammar_mask_cost.py`` measures llguidance, xgrammar and outlines-core on the default
model's 49152 tokens; README): a schema compiles in about 2 ms (xgrammar precomputes its token masks for tens of
ms, outlines-core builds an index for seconds), its limits bound each mask's work, and the wheel needs nothing
else (xgrammar brings transformers and Triton along). Its masks cost about 0.1 ms a token on the CPU, xgrammar's
about a tenth of that: well under a decode step, and computed while the device runs the step of the other slots.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import torch

from gpt_fast.generation.options import OutputConstraint, ToolSpec
from gpt_fast.text.tokenizer import Tokenizer
from gpt_fast.text.tool_calls import ToolCallFormat

# The JSON the engine lets a model write: the separators models saw most (json.dumps's), no other whitespace, so
# that an answer cannot run on in blank lines.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Bytes a grammar may force before the model chooses anything: more is a schema with no end (a recursion that
# never stops), refused when it is compiled.
MAX_FORCED_BYTES = 4096


def mask_words(vocab_size: int) -> int:
    """int32 words of a mask of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


class GrammarError(ValueError):
    """A constraint the grammar engine refuses, or gives up on: the request's mistake (an HTTP 400)."""


class Matcher:
    """One request's place in its grammar: the mask of the tokens allowed next, advanced by each token."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self._matcher = matcher
        self.words = words
        self.tokens = 0  # taken so far
        self._check()

    def fill(self, row: torch.Tensor) -> None:
        """Write the next token's mask into ``row`` [W] (int32, contiguous, in host memory)."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
        self._check()

    def advance(self, token: int) -> None:
        """Take ``token``, sampled under the last mask. After a stop token nothing more is taken."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token)
            self.tokens += 1
            self._check()

    @property
    def finished(self) -> bool:
        """Whether the answer is complete: nothing may follow but a stop token (or one has been taken)."""
        return self._matcher.is_stopped()

    def forced_bytes(self) -> int:
        """How many bytes the grammar forces next, whatever the model chooses."""
        return len(self._matcher.compute_ff_bytes())

    def _check(self) -> None:
        error = first_line(self._matcher.get_error())
        if error and self.tokens:
            raise GrammarError(f"the grammar engine gave up on it after {self.tokens} tokens: {error}")
        if error:
            raise GrammarError(f"the grammar engine refuses it: {error}")


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


class _Vocabulary:
    """What llguidance reads a tokenizer through: each token's bytes, the special ones, and how text encodes."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        known = list(tokenizer.token_bytes[:vocab_size])
        self.tokens = known + [b""] * (vocab_size - len(known))  # ids the model has and the tokenizer lacks
        self.special_token_ids = sorted(i for i in tokenizer.control_ids if i < vocab_size)
        self.eos_token_id = tokenizer.stop_ids[0]
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"), bos=False)


class Grammars:
    """The grammar engine over one tokenizer's vocabulary for a model of ``vocab_size`` tokens (reading it takes
    about half a second: an engine makes this on its first constrained request)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        if not tokenizer.stop_ids:
            raise GrammarError("structured output needs a tokenizer with a stop token: the answer must end")
        vocabulary = _Vocabulary(tokenizer, vocab_size)
        self._tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(vocabulary), n_vocab=vocab_size, eos_token=list(tokenizer.stop_ids)
        )
        self.words = mask_words(vocab_size)

    def matcher(self, constraint: OutputConstraint) -> Matcher:
        """A fresh matcher at the start of ``constraint``'s grammar, its first mask computed. GrammarError if the
        engine refuses the constraint, gives up on it (a limit of its work), or finds that it forces more than
        :data:`MAX_FORCED_BYTES` before the model chooses anything."""
        if constraint.json_schema is not None:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(constraint.json_schema, JSON_LAYOUT)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(constraint.grammar)
        limits = llguidance.LLParserLimits(verbose_errors=False)
        matcher = Matcher(llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=limits), self.words)
        matcher.fill(torch.empty(self.words, dtype=torch.int32))
        if matcher.forced_bytes() >= MAX_FORCED_BYTES:
            raise GrammarError(
                f"it forces more than {MAX_FORCED_BYTES} bytes whatever the model writes: it has no end (a recursion "
                "with no way out?)"
            )
        return matcher


def tool_call_constraint(
    layout: ToolCallFormat,
    tools: Sequence[ToolSpec],
    special_tokens: Mapping[str, int],
    *,
    only: str | None = None,
    parallel: bool = True,
    answer: OutputConstraint | None = None,
) -> OutputConstraint:
    """The constraint of an answer that is tool calls written as the chat template writes them (``layout``; its
    markers' ``special_tokens`` as tokens of their own): calls of ``tools`` (of the one named ``only``), one or
    (``parallel`` and the template writes several) more, each function's arguments held to its parameters' schema;
    or, where ``answer`` (a JSON schema's constraint) is given, a document matching it instead."""
    chosen = [tool for tool in tools if only is None or tool.name == only]
    if not chosen:
        raise GrammarError(f"no tool is named {only!r}")
    several = parallel and layout.parallel and only is None
    repeat = f" ({lark_literal(layout.between, special_tokens)} call)*" if several else ""
    start, end = lark_literal(layout.start, special_tokens), lark_literal(layout.end, special_tokens)
    rules = [
        f"calls: {start} call{repeat} {end}",
        "call: %json " + json.dumps(_call_schema(layout, chosen), ensure_ascii=False),
    ]
    if answer is None:
        return OutputConstraint(grammar="\n".join(["start: calls", *rules]) + "\n")
    if answer.json_schema is None:
        raise GrammarError("tool calls combine with a JSON schema answer only")
    document = json.loads(answer.json_schema) | {"x-guidance": JSON_LAYOUT}
    rules.append("answer: %json " + json.dumps(document, ensure_ascii=False))
    return OutputConstraint(grammar="\n".join(["start: calls | answer", *rules]) + "\n")


def lark_literal(text: str, special_tokens: Mapping[str, int]) -> str:
    """``text`` in Lark: quoted pieces, with the special tokens in it as token references (``<[id]>``)."""
    parts = []
    rest = text
    while rest:
        at, token = min(
            ((rest.find(special), special) for special in special_tokens if special and special in rest),
            default=(len(rest), None),
        )
        if at:
            parts.append(json.dumps(rest[:at], ensure_ascii=False))
        if token is None:
            break
        parts.append(f"<[{special_tokens[token]}]>")
        rest = rest[at + len(token) :]
    return " ".join(parts) or '""'


def _call_schema(layout: ToolCallFormat, tools: Sequence[ToolSpec]) -> dict[str, Any]:
    """One call's JSON object as the template writes it: its keys in the template's order, the function's name, its
    arguments (an object, or that object as JSON text where the template writes a string), fixed values as
    written."""
    choices = []
    for tool in tools:
        arguments: Mapping[str, Any] = tool.parameters or {"type": "object"}
        properties: dict[str, Any] = {}
        for key, value in layout.keys:
            if key == layout.name_key:
                properties[key] = {"const": tool.name}
            elif key == layout.arguments_key:
                properties[key] = {"type": "string"} if layout.arguments_as_text else arguments
            else:
                properties[key] = {"const": value}
        choices.append(
            {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
        )
    schema: dict[str, Any] = choices[0] if len(choices) == 1 else {"anyOf": choices}
    return {**schema, "x-guidance": JSON_LAYOUT}
