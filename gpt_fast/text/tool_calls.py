"""Tool calls as a checkpoint's chat template writes them: how an assistant's calls are laid out (found by rendering
a call, so that it comes from the template and never from a model's name), and the calls read back from an answer
written that way.

A model is trained on conversations its template rendered, tool calls included, so it writes its calls as the
template writes the assistant's calls in the history. :meth:`ToolCallFormat.of_template` renders a conversation
whose assistant turn holds one call (then two) of a probe function, finds each call's JSON object in the text, and
keeps what surrounds it: the text before the first call, between two calls, and after the last (up to the stop
token that ends the turn), and the object's keys (the function's name, its arguments, and any fixed values). A
template that renders no tools, or writes no call as a JSON object, has no format: such a model cannot be asked
for tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from gpt_fast.text.chat_template import ChatTemplateError, render_chat

PROBE_NAME = "probe_function_7341"
PROBE_ARGUMENTS = ({"probe_argument": "first value 7341"}, {"probe_argument": "second value 7341"})
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": PROBE_NAME,
        "description": "A probe function.",
        "parameters": {
            "type": "object",
            "properties": {"probe_argument": {"type": "string", "description": "A probe argument."}},
            "required": ["probe_argument"],
        },
    },
}
PROBE_QUESTION = [{"role": "user", "content": "Probe question 7341."}]


@dataclass(frozen=True)
class ToolCall:
    """A call of the function ``name`` with ``arguments``, a JSON object as text (OpenAI's shape)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallFormat:
    """How a chat template writes an assistant's tool calls: ``start`` + call (+ ``between`` + call ...) + ``end``,
    each call a JSON object whose keys are ``keys`` in order (each with the probe's value: the fixed ones are
    written so), of which ``name_key`` holds the function's name and ``arguments_key`` its arguments (an object, or,
    ``arguments_as_text``, that object as JSON text). ``parallel``: the template writes several calls in a turn."""

    start: str
    between: str
    end: str
    keys: tuple[tuple[str, Any], ...]
    name_key: str
    arguments_key: str
    arguments_as_text: bool
    parallel: bool

    @classmethod
    def of_template(
        cls, template: str, bos_token: str | None, eos_token: str | None, stop_texts: Sequence[str]
    ) -> ToolCallFormat | None:
        """The format ``template`` writes calls in; None if it renders no tools or writes no call as JSON.
        ``stop_texts``: the stop tokens' texts, one of which ends the assistant's turn."""

        def render(calls: int, generation_prompt: bool) -> str | None:
            messages = PROBE_QUESTION + ([probe_turn(calls)] if calls else [])
            try:
                return render_chat(
                    template,
                    messages,
                    bos_token=bos_token,
                    eos_token=eos_token,
                    add_generation_prompt=generation_prompt,
                    tools=[PROBE_TOOL],
                )
            except ChatTemplateError:
                return None

        prompt, one = render(0, True), render(1, False)
        if prompt is None or one is None or PROBE_NAME not in prompt or not one.startswith(prompt):
            return None
        turn = one[len(prompt) :]
        found = find_call(turn, 0)
        if found is None:
            return None
        obj, begin, finish = found
        layout = call_keys(obj)
        if layout is None:
            return None
        end = turn[finish:]
        cut = min((end.find(stop) for stop in stop_texts if stop and stop in end), default=len(end))
        two = render(2, False)
        between = None if two is None or not two.startswith(prompt) else between_calls(two[len(prompt) :], turn[:begin])
        keys, name_key, arguments_key, as_text = layout
        parallel = between is not None
        return cls(turn[:begin], between or "", end[:cut], keys, name_key, arguments_key, as_text, parallel)

    def parse(self, text: str, names: Collection[str]) -> tuple[str, list[ToolCall]]:
        """The calls of the functions ``names`` that ``text`` (an answer, special tokens written out) makes, and the
        text before them; ``(text, [])`` when it makes none. Whitespace around the markers may differ from the
        template's."""
        marker = self.start.strip()
        at = text.find(marker) if marker else len(text) - len(text.lstrip())
        if at < 0 or (not marker and not text[at:].startswith("{")):
            return text, []
        calls: list[ToolCall] = []
        position = at + len(marker)
        while (found := find_object(text, position)) is not None:
            call = self._call(found[0], names)
            if call is None:
                break
            calls.append(call)
            position = found[2]
        return (text[:at].strip(), calls) if calls else (text, [])

    def _call(self, obj: dict[str, Any], names: Collection[str]) -> ToolCall | None:
        name, arguments = obj.get(self.name_key), obj.get(self.arguments_key)
        if self.arguments_as_text and isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if name not in names or not isinstance(arguments, dict):
            return None
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def probe_turn(calls: int) -> dict[str, Any]:
    """An assistant turn of ``calls`` calls of the probe function (with no text), as transformers takes them."""
    return {
        "role": "assistant",
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": PROBE_NAME, "arguments": arguments}}
            for i, arguments in enumerate(PROBE_ARGUMENTS[:calls])
        ],
    }


def find_object(text: str, start: int) -> tuple[dict[str, Any], int, int] | None:
    """The first JSON object at or after ``start`` in ``text`` (only whitespace or text without a brace before it),
    with its span."""
    brace = text.find("{", start)
    if brace < 0:
        return None
    try:
        obj, end = json.JSONDecoder().raw_decode(text, brace)
    except ValueError:
        return None
    return (obj, brace, end) if isinstance(obj, dict) else None


def find_call(text: str, index: int) -> tuple[dict[str, Any], int, int] | None:
    """The innermost JSON object in ``text`` that holds the probe function's name and the ``index``-th probe
    arguments as values of its own, with its span."""
    best = None
    for brace in (i for i, char in enumerate(text) if char == "{"):
        try:
            obj, end = json.JSONDecoder().raw_decode(text, brace)
        except ValueError:
            continue
        if isinstance(obj, dict) and holds_probe(obj, index) and (best is None or end - brace < best[2] - best[1]):
            best = (obj, brace, end)
    return best


def holds_probe(obj: dict[str, Any], index: int) -> bool:
    values = list(obj.values())
    return PROBE_NAME in values and any(is_probe_arguments(value, index) for value in values)


def is_probe_arguments(value: Any, index: int) -> bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return False
    return value == PROBE_ARGUMENTS[index]


def call_keys(obj: dict[str, Any]) -> tuple[tuple[tuple[str, Any], ...], str, str, bool] | None:
    """A probe call object's keys with their values, the name's key, the arguments' key, and whether the
    arguments are written as text."""
    names = [key for key, value in obj.items() if value == PROBE_NAME]
    arguments = [key for key, value in obj.items() if is_probe_arguments(value, 0)]
    if len(names) != 1 or len(arguments) != 1:
        return None
    return tuple(obj.items()), names[0], arguments[0], isinstance(obj[arguments[0]], str)


def between_calls(turn: str, start: str) -> str | None:
    """The text between the two calls of a probe turn that starts as the one-call turn does (``start``)."""
    first, second = find_call(turn, 0), find_call(turn, 1)
    if first is None or second is None or not turn.startswith(start) or first[1] != len(start):
        return None
    return turn[first[2] : second[1]]
