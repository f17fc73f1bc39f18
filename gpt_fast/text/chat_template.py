"""Chat prompts: render a checkpoint's jinja chat template the way Hugging Face transformers does (within the bounds
of :mod:`gpt_fast.text.jinja_sandbox`), and encode it so that message text never becomes control tokens."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from datetime import datetime
from types import TracebackType
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from gpt_fast.text.jinja_sandbox import MAX_TEXT, BoundedEnvironment, bounded_json, render_bounded
from gpt_fast.text.tokenizer import Tokenizer

NO_TEMPLATE_MESSAGE = "this checkpoint has no chat template; use --prompt without --chat"
_SHADOW = ("\ue000", "\ue001")  # private-use characters standing in for message text in the shadow rendering
_TEMPLATE_ERRORS = (
    jinja2.TemplateError,  # syntax errors, undefined names, raise_exception(), the sandbox's SecurityError
    TypeError,
    ValueError,
    ArithmeticError,
    LookupError,
    AttributeError,
    RuntimeError,  # RecursionError among them
)


class ChatTemplateError(ValueError):
    """A chat template that cannot render this conversation (one line, starting "chat template")."""


class ChatTemplateBoundError(ChatTemplateError):
    """A chat template the sandbox stops (:mod:`gpt_fast.text.jinja_sandbox`): too much work, too large a value or
    text, too deep a recursion, or an unsafe attribute. It would fail so on any conversation."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers marks assistant text with it): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """transformers' ``tojson``: plain ``json.dumps``, without jinja's HTML escaping, keeping non-ASCII text."""
    return bounded_json(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = BoundedEnvironment(
        extra_filters={"tojson": _tojson},
        extra_globals={"raise_exception": _raise_exception},
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    return env.from_string(template)


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    bos_token: str | None,
    eos_token: str | None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of ``messages`` (dicts with "role" and "content"; an assistant's "tool_calls", a tool's
    "tool_call_id"), as transformers' ``apply_chat_template(..., tokenize=False)`` renders it, with ``tools`` (the
    functions the model may call, as JSON Schema dicts) as its ``tools`` argument. ChatTemplateError if the template
    fails.

    Like transformers, keys whose value is None are dropped from the messages, and a BOS/EOS token the
    tokenizer does not have is left undefined in the template rather than passed as None.
    """
    return _Chat(template, bos_token, eos_token, add_generation_prompt).render(messages, tools)


def render_chat_spans(
    template: str,
    messages: list[dict[str, Any]],
    *,
    special_tokens: Iterable[str],
    bos_token: str | None,
    eos_token: str | None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """:func:`render_chat`'s text, and the ``[start, end)`` spans of it that message text (or the text of tool calls
    and tools) put there and that hold a ``special_tokens`` string or part of one: the tokenizer reads those as text
    (``literal_spans``).

    The chat is rendered a second time with those characters of the messages (a special-token string, or the
    start or end of one at a message's edge) replaced by private-use characters, keeping lengths and whitespace:
    the two texts differ exactly where the template copied them, through ``trim``, slicing, concatenation or
    ``tojson``. ChatTemplateError if the template writes anything else differently, as it would if it looked for
    such a string in a message.
    """
    chat = _Chat(template, bos_token, eos_token, add_generation_prompt)
    text = chat.render(messages, tools)
    shadows = _Shadows(special_tokens)
    shadowed = [{key: shadows.message_value(key, value) for key, value in message.items()} for message in messages]
    shadowed_tools = None if tools is None else shadows.value(tools)
    if shadowed == messages and shadowed_tools == tools:
        return text, []
    return text, _copied_spans(text, chat.render(shadowed, shadowed_tools))


def chat_prompt_ids(
    tokenizer: Tokenizer,
    template: str | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the rendered chat (with ``tools``, see :func:`render_chat`), in which only the template's own
    markup becomes control tokens: a special-token string typed in a message is encoded as text (as transformers
    does with ``split_special_tokens=True``). No BOS is added: the template writes it when the model wants one (as
    transformers' ``apply_chat_template`` tokenizes with ``add_special_tokens=False``)."""
    if not template:
        raise ValueError(NO_TEMPLATE_MESSAGE)
    text, spans = render_chat_spans(
        template,
        messages,
        special_tokens=tokenizer.special_tokens,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        tools=tools,
    )
    return tokenizer.encode(text, bos=False, literal_spans=spans)


class _Chat:
    """One template and its variables; renders a list of messages, at one fixed time (for ``strftime_now``)."""

    def __init__(self, template: str, bos_token: str | None, eos_token: str | None, generation_prompt: bool) -> None:
        self.template = template
        now = datetime.now()
        named = {"bos_token": bos_token, "eos_token": eos_token}
        self.variables = {
            **{name: value for name, value in named.items() if value is not None},
            "documents": None,
            "add_generation_prompt": generation_prompt,
            "strftime_now": now.strftime,
        }

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        cleaned = [{key: value for key, value in message.items() if value is not None} for message in messages]
        try:
            if len(self.template) > MAX_TEXT:
                raise jinja2.exceptions.SecurityError(f"it is longer than {MAX_TEXT:,} characters")
            variables = {**self.variables, "messages": cleaned, "tools": tools}
            return render_bounded(_compile(self.template), variables)
        except RecursionError:
            raise ChatTemplateBoundError("chat template: it recurses too deeply") from None
        except _TEMPLATE_ERRORS as err:
            where = _template_line(err.__traceback__) or getattr(err, "lineno", None)
            message = " ".join(str(err).split())
            if not isinstance(err, jinja2.TemplateError) or not message:
                message = f"{type(err).__name__}: {message}" if message else type(err).__name__
            error = ChatTemplateBoundError if isinstance(err, jinja2.exceptions.SecurityError) else ChatTemplateError
            raise error(f"chat template{f' line {where}' if where else ''}: {message}") from None


def _template_line(tb: TracebackType | None) -> int | None:
    """The template line of the innermost template frame of a traceback (jinja maps them to template lines)."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


class _Shadows:
    """Message text with the characters that could belong to a special-token string replaced (see
    :func:`render_chat_spans`)."""

    def __init__(self, special_tokens: Iterable[str]) -> None:
        self._tokens = [token for token in special_tokens if token]
        self._starts = {token[:k] for token in self._tokens for k in range(1, len(token))}
        self._ends = {token[k:] for token in self._tokens for k in range(1, len(token))}
        self._longest = max(map(len, self._tokens), default=0)

    def message_value(self, key: str, value: Any) -> Any:
        return value if key == "role" else self.value(value)

    def value(self, value: Any) -> Any:
        """A message's (or a tool's) value with the text in it shadowed, through lists and dicts (not their keys)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(item) for item in value]
        if isinstance(value, dict):
            return {key: self.value(item) for key, item in value.items()}
        return value

    def text(self, text: str) -> str:
        spans = self._spans(text)
        if not spans:
            return text
        chars = list(text)
        for start, end in spans:
            for i in range(start, end):
                if not chars[i].isspace():
                    chars[i] = _SHADOW[chars[i] == _SHADOW[0]]
        return "".join(chars)

    def _spans(self, text: str) -> list[tuple[int, int]]:
        """Where a special-token string occurs, or starts at the end of the text (or of its stripped part), or
        ends at its start; or the whole stripped text when it lies inside one."""
        spans = [(start, start + len(token)) for token in self._tokens for start in _find_all(text, token)]
        first, last = len(text) - len(text.lstrip()), len(text.rstrip())
        for k in range(1, self._longest):
            for left in {0, first}:
                if left + k <= len(text) and text[left : left + k] in self._ends:
                    spans.append((left, left + k))
            for right in {len(text), last}:
                if right >= k and text[right - k : right] in self._starts:
                    spans.append((right - k, right))
        if first < last and last - first < self._longest and any(text[first:last] in t for t in self._tokens):
            spans.append((first, last))
        return spans


def _copied_spans(text: str, shadow: str) -> list[tuple[int, int]]:
    """The spans where ``shadow`` holds a shadow character and ``text`` does not; ChatTemplateError unless the
    two texts are otherwise the same."""
    positions = sorted(i for char in _SHADOW for i in _find_all(shadow, char) if i < len(text) and text[i] != char)
    same = len(text) == len(shadow) and all(
        text[a + 1 : b] == shadow[a + 1 : b] for a, b in zip([-1, *positions], [*positions, len(text)], strict=True)
    )
    if not same:
        raise ChatTemplateError(
            "chat template: a message holds special-token text that the template does not copy as it is "
            "(it looks for it, or changes it); remove it from the message"
        )
    spans: list[tuple[int, int]] = []
    for i in positions:
        if spans and spans[-1][1] == i:
            spans[-1] = (spans[-1][0], i + 1)
        else:
            spans.append((i, i + 1))
    return spans


def _find_all(text: str, sub: str) -> list[int]:
    """Where ``sub`` starts in ``text``, overlaps included."""
    found = []
    i = text.find(sub)
    while i != -1:
        found.append(i)
        i = text.find(sub, i + 1)
    return found
