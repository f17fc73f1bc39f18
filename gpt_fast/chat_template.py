"""Chat prompts: render a checkpoint's jinja chat template the way Hugging Face transformers does."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpt_fast.tokenizer import Tokenizer

NO_TEMPLATE_MESSAGE = "this checkpoint has no chat template; use --prompt without --chat"


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
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(
    template: str,
    messages: list[dict[str, str]],
    *,
    bos_token: str | None,
    eos_token: str | None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of ``messages`` (dicts with "role" and "content"), as transformers'
    ``apply_chat_template(..., tokenize=False)`` renders it.

    Like transformers, keys whose value is None are dropped from the messages, and a BOS/EOS token the
    tokenizer does not have is left undefined in the template rather than passed as None.
    """
    variables: dict[str, Any] = {"bos_token": bos_token, "eos_token": eos_token}
    variables = {name: value for name, value in variables.items() if value is not None}
    cleaned = [{key: value for key, value in message.items() if value is not None} for message in messages]
    return _compile(template).render(
        messages=cleaned, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
    )


def chat_prompt_ids(tokenizer: Tokenizer, template: str | None, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the rendered chat. No BOS is added: the template writes it when the model wants one
    (as transformers' ``apply_chat_template`` tokenizes with ``add_special_tokens=False``)."""
    if not template:
        raise ValueError(NO_TEMPLATE_MESSAGE)
    text = render_chat(template, messages, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    return tokenizer.encode(text, bos=False)
