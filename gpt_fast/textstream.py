"""Incremental detokenization: text for tokens that arrive one at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

CONTEXT_TOKENS = 4  # tokens of already-printed context decoded with each new one (for leading spaces, merges)


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str: ...


class TextStream:
    """Write the text of each new token as soon as it is complete.

    Each step decodes a short window (some already-printed tokens plus the new ones) and writes what the new
    tokens added; text ending in an incomplete UTF-8 sequence (U+FFFD) is held back until the next token.
    """

    def __init__(self, tokenizer: Decoder, context_ids: Sequence[int], write: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.write = write
        self.ids = list(context_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token: int) -> None:
        self.ids.append(token)
        printed = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special=True)
        if len(full) > len(printed) and not full.endswith("\ufffd"):
            self.write(full[len(printed) :])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
