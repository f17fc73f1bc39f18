"""Structured output and tool calling in the OpenAI API: ``response_format``, ``tools`` and ``tool_choice`` checked
into a constraint and the tools the chat template is given; the tool messages of a conversation; the calls an
answer makes, whole or streamed.

What each asks of the model:

- ``response_format`` ``json_object`` (any JSON object) or ``json_schema`` (a document matching the schema,
  ``strict`` or not): the answer is held to it by the grammar engine. Completions take it too (an extension).
- ``tools`` go to the chat template (as transformers passes them), which tells the model of them. ``tool_choice``
  ``auto`` (the default): the model answers freely, and the calls it writes in its template's format become
  ``tool_calls``; ``required``, or a named function: the answer is held to calls (of that function) in that format,
  each function's arguments to its parameters' schema; ``none``: the model is not told of the tools.
  ``parallel_tool_calls: false``: one call at most.
- With ``auto`` and a ``response_format``, the answer is held to either: calls, or the document.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gpt_fast.generation.options import OutputConstraint, ToolSpec
from gpt_fast.serve.errors import APIError
from gpt_fast.util.options import OptionError

MAX_TOOLS = 128  # OpenAI's limits: tools in a request, and a function's name
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("none", "auto", "required")
ToolCallList = list[tuple[str, str]]  # (function name, arguments as JSON text), in order


def response_format(value: Any) -> OutputConstraint | None:
    """``response_format``: ``{"type": "text"}`` (None), ``json_object``, or ``json_schema`` with
    ``{"name", "schema", "strict", "description"}``."""
    if value is None:
        return None
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise APIError(400, f"response_format must be an object whose type is one of {', '.join(kinds)}", param=_RF)
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return OutputConstraint.json_object()
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or set(spec) - {"name", "schema", "strict", "description"}:
        raise APIError(400, "response_format.json_schema must be {name, schema, strict, description}", param=_RF)
    if not isinstance(spec.get("name"), str) or not NAME.fullmatch(spec["name"]):
        raise APIError(400, "response_format.json_schema.name must be 1-64 letters, digits, _ or -", param=_RF)
    if spec.get("strict") not in (None, True, False):
        raise APIError(400, "response_format.json_schema.strict must be true or false", param=_RF)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON Schema object", param=_RF)
    return _constraint(lambda: OutputConstraint.from_schema(schema), _RF)


_RF = "response_format"


@dataclass(frozen=True)
class Tools:
    """A chat request's tools: ``functions`` as OpenAI gives them (for the chat template), the ``choice`` of
    :data:`TOOL_CHOICES` but ``none`` or ``function`` (``only``: its name), and whether several calls may come."""

    functions: tuple[dict[str, Any], ...]
    choice: str
    only: str | None
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset(function["function"]["name"] for function in self.functions)

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        return tuple(ToolSpec(f["function"]["name"], f["function"].get("parameters")) for f in self.functions)

    @property
    def forced(self) -> bool:
        """Whether the answer must be calls."""
        return self.choice != "auto"


def tools_of(tools: Any, choice: Any, parallel: bool) -> Tools | None:
    """``tools`` and ``tool_choice`` (``parallel``: ``parallel_tool_calls`` is not false); None without tools or
    with ``tool_choice: "none"``."""
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise APIError(400, f"tools must be an array of 1 to {MAX_TOOLS} tools", param="tools")
    functions = tuple(_function(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [function["function"]["name"] for function in functions]
    if len(set(names)) != len(names):
        raise APIError(400, "tools name a function twice", param="tools")
    kind, only = _choice(choice, names)
    return None if kind == "none" else Tools(functions, kind, only, parallel)


def _function(tool: Any, where: str) -> dict[str, Any]:
    """A tool: ``{"type": "function", "function": {"name", "description", "parameters", "strict"}}``."""
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict) or set(tool) - {"type", "function"}:
        raise APIError(400, f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
    if set(function) - {"name", "description", "parameters", "strict"}:
        raise APIError(400, f"{where}.function takes name, description, parameters and strict", param=where)
    if not isinstance(function.get("name"), str) or not NAME.fullmatch(function["name"]):
        raise APIError(400, f"{where}.function.name must be 1-64 letters, digits, _ or -", param=where)
    if not isinstance(function.get("description", ""), str) or function.get("strict") not in (None, True, False):
        raise APIError(400, f"{where}.function: description is text, strict true or false", param=where)
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON Schema object", param=where)
        _constraint(lambda: OutputConstraint.from_schema(parameters), where)
    return {"type": "function", "function": function}


def _choice(choice: Any, names: Sequence[str]) -> tuple[str, str | None]:
    if choice is None or choice in TOOL_CHOICES:
        return choice or "auto", None
    named = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(named, dict) or named.get("name") not in names:
        named_one = '{"type": "function", "function": {"name"}} naming a tool'
        message = f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or {named_one}"
        raise APIError(400, message, param="tool_choice")
    return "function", named["name"]


def _constraint(make: Callable[[], OutputConstraint], param: str) -> OutputConstraint:
    try:
        return make()
    except OptionError as err:
        raise APIError(400, f"{param}: {err}", param=param) from None


def tool_fields(message: dict[str, Any], where: str, calls: dict[str, str]) -> dict[str, Any]:
    """The fields a message has beside its role and text, as the chat template takes them: a tool message's
    ``tool_call_id`` and the name of the function whose call it answers (from ``calls``: call id -> function name);
    an assistant's ``tool_calls``, their arguments as objects (added to ``calls``)."""
    if message.get("role") == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise APIError(400, f"{where}.tool_call_id must be the id of the call it answers", param=where)
        return {"tool_call_id": call_id, "name": calls.get(call_id)}
    given = message.get("tool_calls")
    if message.get("role") != "assistant" or given is None:
        return {}
    if not isinstance(given, list) or not given:
        raise APIError(400, f"{where}.tool_calls must be a non-empty array", param=where)
    return {"tool_calls": [_history_call(call, f"{where}.tool_calls[{i}]", calls) for i, call in enumerate(given)]}


def _history_call(call: Any, where: str, calls: dict[str, str]) -> dict[str, Any]:
    """An assistant's call ``{"id", "type": "function", "function": {"name", "arguments"}}``, arguments JSON text."""
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not isinstance(call.get("id"), str) or call.get("type", "function") != "function":
        shape = '{"id", "type": "function", "function": {"name", "arguments"}}'
        raise APIError(400, f"{where} must be {shape}", param=where)
    try:
        arguments = json.loads(function.get("arguments", "{}"))
    except (TypeError, ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object, as text", param=where)
    calls[call["id"]] = name
    return {"id": call["id"], "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_call_objects(calls: ToolCallList) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` of a message: each with a fresh id."""
    return [
        {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for name, arguments in calls
    ]


def tool_finish(reason: str) -> str:
    """A choice's finish reason once it made calls: ``tool_calls``, unless its token budget cut it."""
    return "length" if reason == "length" else "tool_calls"


class ToolStream:
    """A streamed choice's text while the model may write tool calls: given out until the template's call marker
    (``marker``, as the stream shows it) appears, then held; with no visible marker (a call opens with special
    tokens, or is a bare JSON object), held from the start. The calls are read at the end, from all the tokens."""

    def __init__(self, marker: str, forced: bool) -> None:
        self.marker = marker
        self.holding = forced or not marker
        self.pending = ""  # text held back

    def push(self, text: str) -> str:
        """The text that may be given out now: up to the marker, less what may be the marker's start."""
        self.pending += text
        if self.holding:
            return ""
        at = self.pending.find(self.marker)
        self.holding = at >= 0
        cut = at if self.holding else len(self.pending) - marker_start(self.pending, self.marker)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def end(self, calls: ToolCallList) -> str:
        """The text still to give out once the answer has ended: none if it made calls."""
        return "" if calls else self.pending


def marker_start(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)
