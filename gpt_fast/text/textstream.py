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
        self._write_new(final=False)

    def flush(self) -> None:
        """Write what is held back: the text has ended, an incomplete UTF-8 sequence at its end included (as
        U+FFFD, as a decode of all the tokens would give it)."""
        self._write_new(final=True)

    def _write_new(self, final: bool) -> None:
        printed = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special=True)
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special=True)
        if len(full) > len(printed) and (final or not full.endswith("\ufffd")):
            self.write(full[len(printed) :])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)


class StopStrings:
    """Text cut at the first of some stop strings, given out as it comes, the stop string itself left out.

    The end of the text that could be the start of a stop string is held back until the next text shows whether it
    is one. An occurrence can only start in the held-back text, so that only it is searched.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The text that can be given out now; once a stop string has appeared (``stopped``), the text before it."""
        self.pending += text
        found = [at for at in (self.pending.find(stop) for stop in self.stops) if at >= 0]
        if found:
            self.stopped = True
            out, self.pending = self.pending[: min(found)], ""
            return out
        cut = len(self.pending) - self._held_back()
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """The text held back: the text has ended without a stop string."""
        out, self.pending = self.pending, ""
        return out

    def _held_back(self) -> int:
        """The length of the longest end of the pending text that begins a stop string."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest
