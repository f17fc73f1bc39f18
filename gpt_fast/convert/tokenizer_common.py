"""What both tokenizer converters share: file names, SentencePiece's piece types, and the stop token a chat template
ends an assistant turn with."""

from __future__ import annotations

import dataclasses

from gpt_fast.model.config import TokenizerConfig
from gpt_fast.text.chat_template import ChatTemplateBoundError, ChatTemplateError, render_chat

# The pre-tokenizer regex of Meta's Llama 3 tiktoken tokenizer: the default for tiktoken-format files.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOKENIZER_JSON = "tokenizer.json"

_TEMPLATE_PROBE = "Probe reply 7341."  # assistant text rendered to find what a chat template writes after it

# SentencePiece piece types (sentencepiece_model.proto) and GGUF token types share these numbers.
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4


def with_template_stop_id(cfg: TokenizerConfig, template: str | None, where: str) -> TokenizerConfig:
    """``cfg`` with the special token the chat template writes right after an assistant message added to its
    stop ids (an end-of-turn token such as Llama 3's, which a checkpoint's EOS metadata does not always list).

    Found by rendering a short conversation, so it depends on what the template writes, not on token names. A
    template that rejects that conversation leaves the stop ids as they are; one the sandbox stops (too much work,
    too large, too deep, unsafe) is refused, as generation would refuse it, with ``where`` naming it.
    """
    if not template:
        return cfg
    text = _render_probe(template, cfg.bos_token, cfg.eos_token, where)
    if text is None:
        return cfg
    _, found, after = text.rpartition(_TEMPLATE_PROBE)
    after = after.lstrip()
    token = next((t for t in sorted(cfg.special_tokens, key=len, reverse=True) if t and after.startswith(t)), None)
    if not found or token is None or cfg.special_tokens[token] in cfg.stop_ids:
        return cfg
    return dataclasses.replace(cfg, stop_ids=(*cfg.stop_ids, cfg.special_tokens[token]))


def check_template_bounds(template: str | None, where: str) -> None:
    """Refuse a chat template the sandbox stops on a short conversation (see :func:`with_template_stop_id`), before
    any weights are converted."""
    if template:
        _render_probe(template, None, None, where)


def _render_probe(template: str, bos_token: str | None, eos_token: str | None, where: str) -> str | None:
    """A short conversation rendered by ``template``; None if the template rejects it; a ValueError naming
    ``where`` if the sandbox stops it."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _TEMPLATE_PROBE}]
    try:
        return render_chat(template, messages, bos_token=bos_token, eos_token=eos_token, add_generation_prompt=False)
    except ChatTemplateBoundError as err:
        raise ValueError(f"{where}: {err}") from None
    except ChatTemplateError:  # a template that rejects the probe
        return None
