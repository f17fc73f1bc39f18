"""What both tokenizer converters share: file names, the byte alphabet of byte-level BPE, SentencePiece's piece
types, and the stop token a chat template ends an assistant turn with."""

from __future__ import annotations

import dataclasses

from gpt_fast.model.config import TokenizerConfig
from gpt_fast.text.chat_template import ChatTemplateError, render_chat

# The pre-tokenizer regex of Meta's Llama 3 tiktoken tokenizer: the default for tiktoken-format files.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOKENIZER_JSON = "tokenizer.json"

_TEMPLATE_PROBE = "Probe reply 7341."  # assistant text rendered to find what a chat template writes after it

# SentencePiece piece types (sentencepiece_model.proto) and GGUF token types share these numbers.
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4


def with_template_stop_id(cfg: TokenizerConfig, template: str | None) -> TokenizerConfig:
    """``cfg`` with the special token the chat template writes right after an assistant message added to its
    stop ids (an end-of-turn token such as Llama 3's, which a checkpoint's EOS metadata does not always list).

    Found by rendering a short conversation, so it depends on what the template writes, not on token names.
    """
    if not template:
        return cfg
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _TEMPLATE_PROBE}]
    try:
        text = render_chat(
            template, messages, bos_token=cfg.bos_token, eos_token=cfg.eos_token, add_generation_prompt=False
        )
    except ChatTemplateError:  # a template that rejects the probe
        return cfg
    _, found, after = text.rpartition(_TEMPLATE_PROBE)
    after = after.lstrip()
    token = next((t for t in sorted(cfg.special_tokens, key=len, reverse=True) if t and after.startswith(t)), None)
    if not found or token is None or cfg.special_tokens[token] in cfg.stop_ids:
        return cfg
    return dataclasses.replace(cfg, stop_ids=(*cfg.stop_ids, cfg.special_tokens[token]))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
