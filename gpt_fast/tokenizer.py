"""Runtime tokenizers: SentencePiece, tiktoken and Hugging Face ``tokenizer.json``, behind one interface.

Each gives the ids Hugging Face transformers gives for the same files (SentencePiece: those sentencepiece gives,
see SentencePieceTokenizer): special-token strings in the text (as a rendered chat template holds them) become their
ids, and BOS is added here, as the checkpoint config says.
"""

from __future__ import annotations

import base64
import binascii
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm
import tiktoken
import tokenizers

from gpt_fast.config import TokenizerConfig

SPACE_MARK = "\u2581"  # SentencePiece's visible space, "▁"
_SPACE_RUN = re.compile(" {2,}")
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what "surrogateescape" makes of a byte that is not UTF-8


class Tokenizer(ABC):
    """Text <-> token ids for one checkpoint, with its BOS and stop tokens."""

    def __init__(self, cfg: TokenizerConfig) -> None:
        self.cfg = cfg

    @property
    def bos_id(self) -> int | None:
        return self.cfg.bos_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.cfg.stop_ids

    @property
    def bos_token(self) -> str | None:
        return self.cfg.bos_token

    @property
    def eos_token(self) -> str | None:
        return self.cfg.eos_token

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (largest id + 1)."""

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """Token ids of ``text``; starts with BOS when ``bos`` and the checkpoint adds one."""
        ids = self._encode(text)
        if bos and self.cfg.add_bos:
            return [self.cfg.bos_id, *ids]
        return ids

    @abstractmethod
    def _encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; ids the tokenizer does not know are left out."""


class _SpecialSplitter:
    """Cuts text at special-token strings, leftmost and then longest match first, as ``tokenizers`` matches
    added tokens. Yields ``(offset, piece)``: ``piece`` is the special token's id, or a run of ordinary text."""

    def __init__(self, special_tokens: dict[str, int]) -> None:
        self._ids = {text: token_id for text, token_id in special_tokens.items() if text}
        alternatives = sorted(self._ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    def split(self, text: str) -> list[tuple[int, str | int]]:
        if self._pattern is None:
            return [(0, text)] if text else []
        parts: list[tuple[int, str | int]] = []
        start = 0
        for match in self._pattern.finditer(text):
            if match.start() > start:
                parts.append((start, text[start : match.start()]))
            parts.append((match.start(), self._ids[match.group()]))
            start = match.end()
        if start < len(text):
            parts.append((start, text[start:]))
        return parts


def read_sentencepiece_proto(path: Path, data: bytes | None = None) -> Any:
    """The ``ModelProto`` of a SentencePiece model file; ValueError if it is not one."""
    from google.protobuf.message import DecodeError
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes() if data is None else data)
    except DecodeError as err:
        raise ValueError(f"{path} is not a SentencePiece model: {err}") from None
    if not proto.pieces:
        raise ValueError(f"{path} is not a SentencePiece model: it holds no pieces")
    return proto


def read_tiktoken_ranks(path: Path, data: bytes | None = None) -> dict[bytes, int]:
    """The ``{token bytes: rank}`` of a tiktoken BPE file (lines of ``base64-token rank``)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate((path.read_bytes() if data is None else data).splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected two fields")
            ranks[base64.b64decode(fields[0], validate=True)] = int(fields[1])
        except (ValueError, binascii.Error):
            raise ValueError(f"{path} is not a tiktoken BPE file (line {number} is not 'base64-token rank')") from None
    if not ranks:
        raise ValueError(f"{path} is not a tiktoken BPE file: it holds no tokens")
    return ranks


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``tokenizer.model`` (Llama 2, Mistral, TinyLlama, open_llama).

    Text is encoded as sentencepiece encodes it with the model's own normalizer (``nmt_nfkc`` and its whitespace
    handling included), which is how these models were trained and how Meta's and open_llama's reference code
    tokenize. Special tokens are matched in the text, as transformers matches them, and stand in the text as
    opaque symbols: no dummy prefix goes next to them, and whitespace beside them is kept as sentencepiece keeps
    whitespace in the middle of a text (one "▁" for a run of spaces when the model removes extra whitespace).
    """

    def __init__(self, path: Path, cfg: TokenizerConfig) -> None:
        super().__init__(cfg)
        proto = read_sentencepiece_proto(path)
        spec = proto.normalizer_spec
        self._sp = _processor(path, proto)
        # The model's normalizer alone (no whitespace handling), and the model with no normalizer at all: text
        # next to a special token is normalized by the first, its whitespace handled here, and segmented by the
        # second.
        self._normalizer = _processor(
            path, proto, add_dummy_prefix=False, remove_extra_whitespaces=False, escape_whitespaces=False
        )
        self._segmenter = _processor(
            path,
            proto,
            name="identity",
            precompiled_charsmap=b"",
            add_dummy_prefix=False,
            remove_extra_whitespaces=False,
        )
        self._dummy_prefix = spec.add_dummy_prefix
        self._collapse = spec.remove_extra_whitespaces
        self._trailing = " " + SPACE_MARK if spec.escape_whitespaces else " "
        self._pieces = self._sp.get_piece_size()
        self._splitter = _SpecialSplitter(cfg.special_tokens)
        self._special_text = {token_id: text for text, token_id in cfg.special_tokens.items()}
        self._skipped = {i for i in range(self._pieces) if self._sp.is_control(i) or self._sp.is_unknown(i)}
        self._skipped |= {i for i in self._special_text if i >= self._pieces}
        # byte pieces are "<0xNN>"
        self._bytes = {i: int(self._sp.id_to_piece(i)[3:5], 16) for i in range(self._pieces) if self._sp.is_byte(i)}

    @property
    def vocab_size(self) -> int:
        return max([self._pieces - 1, *self._special_text]) + 1

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for offset, part in self._splitter.split(text):
            if isinstance(part, int):
                ids.append(part)
            else:
                ids.extend(self._encode_run(part, starts=offset == 0, ends=offset + len(part) == len(text)))
        return ids

    def _encode_run(self, run: str, starts: bool, ends: bool) -> list[int]:
        """Ids of a run of text between special tokens; ``starts``/``ends``: it starts/ends the input.

        The whole input is encoded by sentencepiece itself. Otherwise the run is normalized by the model's
        normalizer and its whitespace handled as sentencepiece handles it: with ``remove_extra_whitespaces``,
        runs of spaces become one and spaces at the start and end of the input go, while spaces next to a special
        token stay as one; the dummy prefix goes only before text that starts the input.
        """
        if starts and ends:
            return self._sp.encode(run)
        text = self._normalizer.normalize(run)
        if self._collapse:
            text = _SPACE_RUN.sub(" ", text)
            text = text.lstrip(" ") if starts else text
            text = text.rstrip(self._trailing) if ends else text
        if starts and self._dummy_prefix and text:
            text = " " + text
        return self._segmenter.encode(text)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Decode as sentencepiece does, with special tokens written out (left out with ``skip_special``): "▁" is a
        space, byte pieces are UTF-8 (U+FFFD per invalid byte), and the first piece loses its leading "▁" (the
        dummy prefix); with ``remove_extra_whitespaces``, every piece does until some text is written."""
        out: list[str] = []
        pending = bytearray()
        stripping = self._dummy_prefix or self._collapse
        for token_id in ids:
            if token_id not in self._special_text and not 0 <= token_id < self._pieces:
                continue
            if skip_special and token_id in self._skipped:
                continue
            if token_id in self._bytes:
                pending.append(self._bytes[token_id])
                continue
            out.append(_utf8_or_replacement(pending))
            pending.clear()
            if token_id in self._special_text:
                out.append(self._special_text[token_id])
                continue
            piece = self._sp.id_to_piece(token_id)
            if stripping and any(out):
                stripping = False
            elif stripping:
                piece, stripping = piece.removeprefix(SPACE_MARK), self._collapse
            out.append(piece.replace(SPACE_MARK, " "))
        out.append(_utf8_or_replacement(pending))
        return "".join(out)


def _processor(path: Path, proto: Any, **normalizer: Any) -> spm.SentencePieceProcessor:
    """A sentencepiece processor for ``proto`` with the given fields of its normalizer spec changed."""
    changed = type(proto)()
    changed.CopyFrom(proto)
    for field, value in normalizer.items():
        setattr(changed.normalizer_spec, field, value)
    try:
        return spm.SentencePieceProcessor(model_proto=changed.SerializeToString())
    except RuntimeError as err:
        raise ValueError(f"cannot load SentencePiece model {path}: {err}") from None


def _utf8_or_replacement(data: bytes) -> str:
    """UTF-8 text of byte pieces, each byte that is not part of a valid character made U+FFFD (as sentencepiece
    decodes them)."""
    return _ESCAPED_BYTE.sub("\ufffd", data.decode("utf-8", errors="surrogateescape"))


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file (Meta's Llama 3 ``original/tokenizer.model``) with the config's pattern and specials."""

    def __init__(self, path: Path, cfg: TokenizerConfig) -> None:
        super().__init__(cfg)
        ranks = read_tiktoken_ranks(path)
        try:
            self._enc = tiktoken.Encoding(
                name=path.name, pat_str=cfg.pattern, mergeable_ranks=ranks, special_tokens=cfg.special_tokens
            )
        except ValueError as err:
            raise ValueError(f"cannot build a tiktoken encoding from {path}: {err}") from None
        self._special = set(cfg.special_tokens.values())
        self._known = set(ranks.values()) | self._special
        self._splitter = _SpecialSplitter(cfg.special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for _, part in self._splitter.split(text):
            if isinstance(part, int):
                ids.append(part)
            else:
                ids.extend(self._enc.encode_ordinary(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        kept = [i for i in ids if i in self._known and not (skip_special and i in self._special)]
        return self._enc.decode(kept, errors="replace")


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``, through the ``tokenizers`` library (BOS is added by us, not by it)."""

    def __init__(self, path: Path, cfg: TokenizerConfig) -> None:
        super().__init__(cfg)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a plain Exception for unreadable files
            raise ValueError(f"cannot read tokenizer file {path}: {err}") from None
        self._register_specials(path)

    def _register_specials(self, path: Path) -> None:
        """Make every special token of the config an added token (transformers adds those the file lacks)."""
        known = self._tok.get_added_tokens_decoder()
        missing = [text for text, token_id in self.cfg.special_tokens.items() if token_id not in known]
        self._tok.add_special_tokens([tokenizers.AddedToken(text, special=True, normalized=False) for text in missing])
        for text in missing:
            if self._tok.token_to_id(text) != self.cfg.special_tokens[text]:
                raise ValueError(
                    f"{path}: special token {text!r} has id {self._tok.token_to_id(text)}, the config says "
                    f"{self.cfg.special_tokens[text]}"
                )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)


_KINDS: dict[str, type[Tokenizer]] = {
    "sentencepiece": SentencePieceTokenizer,
    "tiktoken": TiktokenTokenizer,
    "huggingface": HuggingFaceTokenizer,
}


def load_tokenizer(checkpoint_dir: Path, cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer a converted checkpoint's config describes."""
    path = Path(checkpoint_dir) / cfg.file
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return _KINDS[cfg.kind](path, cfg)
