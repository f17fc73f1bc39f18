"""Runtime tokenizers: SentencePiece, tiktoken and Hugging Face ``tokenizer.json``, behind one interface.

Each gives the ids Hugging Face transformers gives for the same files (SentencePiece: those sentencepiece gives,
see SentencePieceTokenizer): special-token strings in the text (as a rendered chat template holds them) become their
ids, and BOS is added here, as the checkpoint config says. Parts of the text can be marked literal (message text in
a rendered chat): special-token strings there stay ordinary text, encoded as transformers encodes them with
``split_special_tokens=True``.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import functools
import json
import re
import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm
import tiktoken
import tokenizers

from gpt_fast.model.config import TokenizerConfig

SPACE_MARK = "\u2581"  # SentencePiece's visible space, "▁"
_SPACE_RUN = re.compile(" {2,}")
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what "surrogateescape" makes of a byte that is not UTF-8
MAX_TOKEN_ID = 2**31 - 1  # token ids (tiktoken ranks) are int32 in the model's embedding lookup
PLAIN_TEXT_PROBE = "Hello, world! The year is 2024."  # a tokenizer that cannot encode this cannot encode prompts


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

    @property
    def special_tokens(self) -> dict[str, int]:
        """Text -> id of the special (control) tokens that encoding matches in text."""
        return self.cfg.special_tokens

    def encode(self, text: str, bos: bool = True, *, literal_spans: Iterable[tuple[int, int]] = ()) -> list[int]:
        """Token ids of ``text``; starts with BOS when ``bos`` and the checkpoint adds one.

        Special-token strings in ``text`` become their ids, except those overlapping a ``literal_spans`` range
        (``[start, end)`` character offsets): those are ordinary text, as transformers encodes text with
        ``split_special_tokens=True``. ValueError if ``text`` is not valid Unicode.
        """
        check_text(text)
        ids = self._encode(text, Spans(literal_spans))
        if bos and self.cfg.add_bos:
            return [self.cfg.bos_id, *ids]
        return ids

    @abstractmethod
    def _encode(self, text: str, literal: Spans) -> list[int]: ...

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; ids the tokenizer does not know are left out."""

    @functools.cached_property
    def token_bytes(self) -> tuple[bytes, ...]:
        """What each id ``0 .. vocab_size - 1`` writes into the text, as UTF-8 bytes, wherever it stands (a token
        that starts the text writes its leading space too, which decoding a whole text may drop); a special
        token's entry is its text, an id the tokenizer does not know writes nothing (``b""``). A grammar engine
        reads the vocabulary so (:mod:`gpt_fast.generation.constraint`). ValueError for a tokenizer whose pieces
        do not say their bytes."""
        return tuple(self._token_bytes())

    @abstractmethod
    def _token_bytes(self) -> list[bytes]: ...

    @property
    @abstractmethod
    def control_ids(self) -> frozenset[int]:
        """The ids that are never text: special and control tokens (stop tokens among them)."""


def check_text(text: str) -> None:
    """ValueError unless ``text`` is valid Unicode text. Python keeps the bytes of a command-line argument that are
    not UTF-8 as lone surrogates U+DC80..U+DCFF; no tokenizer can encode those, and some would drop them silently."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        what = f"byte 0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise ValueError(f"the prompt is not valid UTF-8: {what} at character {err.start}") from None


class Spans:
    """Character ranges ``[start, end)`` of a text, merged and sorted."""

    def __init__(self, spans: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[list[int]] = []
        for start, end in sorted((start, end) for start, end in spans if start < end):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._starts = [start for start, _ in merged]
        self._ends = [end for _, end in merged]

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(zip(self._starts, self._ends, strict=True))

    def overlaps(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` shares a character with a span."""
        last = bisect.bisect_left(self._starts, end) - 1  # the last span starting before ``end``
        return last >= 0 and self._ends[last] > start


class _SpecialSplitter:
    """Cuts text at special-token strings, leftmost and then longest match first, as ``tokenizers`` matches
    added tokens. Yields ``(offset, piece)``: ``piece`` is the special token's id, or a run of ordinary text.
    A match overlapping a literal span is left in the text (as ``tokenizers`` skips special tokens when it
    encodes with ``encode_special_tokens``: the text it covers is not searched again)."""

    def __init__(self, special_tokens: dict[str, int]) -> None:
        self._ids = {text: token_id for text, token_id in special_tokens.items() if text}
        alternatives = "|".join(map(re.escape, sorted(self._ids, key=len, reverse=True)))
        self._pattern = re.compile(alternatives) if alternatives else None
        self._anywhere = re.compile(f"(?=({alternatives}))") if alternatives else None
        self._longest = max(map(len, self._ids), default=0)

    def touches(self, text: str, literal: Spans) -> bool:
        """Whether any special-token string occurs in ``text`` overlapping a literal span."""
        if self._anywhere is None:
            return False
        for start, end in literal:
            window = max(0, start - self._longest + 1)
            for match in self._anywhere.finditer(text, window, end + self._longest - 1):
                if match.start() < end and match.start() + len(match.group(1)) > start:
                    return True
        return False

    def split(self, text: str, literal: Spans | None = None) -> list[tuple[int, str | int]]:
        if self._pattern is None:
            return [(0, text)] if text else []
        parts: list[tuple[int, str | int]] = []
        start = 0
        for match in self._pattern.finditer(text):
            if literal and literal.overlaps(*match.span()):
                continue
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


class NotTiktokenError(ValueError):
    """A file that is not in the tiktoken BPE format at all (rather than one in that format with wrong content)."""


def read_tiktoken_ranks(path: Path, data: bytes | None = None) -> dict[bytes, int]:
    """The ``{token bytes: rank}`` of a tiktoken BPE file (lines of ``base64-token rank``): each token once, each
    rank once and in ``0..MAX_TOKEN_ID``, and every single byte a token (tiktoken cannot encode text otherwise).
    NotTiktokenError if the file is not in that format, ValueError if its content is wrong."""
    ranks: dict[bytes, int] = {}
    lines: dict[int, int] = {}  # rank -> line number
    for number, line in enumerate((path.read_bytes() if data is None else data).splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected two fields")
            token, rank = base64.b64decode(fields[0], validate=True), int(fields[1])
        except (ValueError, binascii.Error):
            raise NotTiktokenError(
                f"{path} is not a tiktoken BPE file (line {number} is not 'base64-token rank')"
            ) from None
        if not 0 <= rank <= MAX_TOKEN_ID:
            raise ValueError(f"{path} line {number}: rank {rank} is outside 0..{MAX_TOKEN_ID}")
        if token in ranks:
            raise ValueError(f"{path} line {number}: token {fields[0].decode()} is listed twice")
        if rank in lines:
            raise ValueError(f"{path} line {number}: rank {rank} is already the rank of line {lines[rank]}")
        ranks[token], lines[rank] = rank, number
    if not ranks:
        raise NotTiktokenError(f"{path} is not a tiktoken BPE file: it holds no tokens")
    missing = [f"0x{byte:02X}" for byte in range(256) if bytes([byte]) not in ranks]
    if missing:
        raise ValueError(
            f"{path}: the tiktoken BPE file lacks the single-byte tokens {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}; it cannot encode every text"
        )
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

    def _encode(self, text: str, literal: Spans) -> list[int]:
        ids: list[int] = []
        for offset, part in self._splitter.split(text, literal):
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

    def _token_bytes(self) -> list[bytes]:
        """A piece's text with "▁" as a space, a byte piece its byte, a special token its text, a control or unknown
        piece nothing."""
        out = []
        for token_id in range(self.vocab_size):
            if token_id in self._special_text:
                out.append(self._special_text[token_id].encode())
            elif token_id in self._bytes:
                out.append(bytes([self._bytes[token_id]]))
            elif token_id in self._skipped or token_id >= self._pieces:
                out.append(b"")
            else:
                out.append(self._sp.id_to_piece(token_id).replace(SPACE_MARK, " ").encode())
        return out

    @property
    def control_ids(self) -> frozenset[int]:
        return frozenset(self._skipped | set(self._special_text))


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

    def _encode(self, text: str, literal: Spans) -> list[int]:
        ids: list[int] = []
        for _, part in self._splitter.split(text, literal):
            if isinstance(part, int):
                ids.append(part)
            else:
                ids.extend(self._enc.encode_ordinary(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        kept = [i for i in ids if i in self._known and not (skip_special and i in self._special)]
        return self._enc.decode(kept, errors="replace")

    def _token_bytes(self) -> list[bytes]:
        return [self._enc.decode_single_token_bytes(i) if i in self._known else b"" for i in range(self.vocab_size)]

    @property
    def control_ids(self) -> frozenset[int]:
        return frozenset(self._special)


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``, through the ``tokenizers`` library (BOS is added by us, not by it)."""

    def __init__(self, path: Path, cfg: TokenizerConfig) -> None:
        super().__init__(cfg)
        self._path = path
        self._tok = read_tokenizer_json(path)
        self._register_specials(path)
        self._splitter = _SpecialSplitter(cfg.special_tokens)
        self._literal_tokenizers: dict[str, tokenizers.Tokenizer] = {}

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

    def _encode(self, text: str, literal: Spans) -> list[int]:
        """``tokenizers`` cuts the text at added tokens and encodes each piece between them on its own. With a
        special-token string in a literal span, the text is cut here instead, where ``tokenizers`` would cut it,
        leaving out those matches; each piece is then encoded by ``tokenizers`` as it would encode it there."""
        if not self._splitter.touches(text, literal):
            return self._tok.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        start = 0
        for cut_start, cut_end, token_id in self._added_tokens.cuts(text, literal):
            ids += self._encode_piece(text, start, cut_start, literal)
            ids.append(token_id)
            start = cut_end
        return ids + self._encode_piece(text, start, len(text), literal)

    @functools.cached_property
    def _added_tokens(self) -> _AddedTokens:
        return _AddedTokens(self._tok.get_added_tokens_decoder(), set(self.cfg.special_tokens))

    def _encode_piece(self, text: str, start: int, end: int, literal: Spans) -> list[int]:
        """Ids of ``text[start:end]``, a piece between two added tokens: special tokens in it are text if it
        overlaps a literal span. A piece not at the start of the text is encoded after a sentinel added token,
        as what it depends on its position (a Metaspace "▁" only at the start) sees it where it is."""
        if start >= end:
            return []
        piece = text[start:end]
        as_text = literal.overlaps(start, end)
        if start == 0 and not as_text:
            return self._tok.encode(piece, add_special_tokens=False).ids
        sentinel = _SENTINEL_CHAR * (1 + max(map(len, re.findall(f"{_SENTINEL_CHAR}+", piece)), default=0))
        tok = self._literal_tokenizer(sentinel)
        tok.encode_special_tokens = as_text
        if start == 0:
            return tok.encode(piece, add_special_tokens=False).ids
        ids = tok.encode(sentinel + piece, add_special_tokens=False).ids
        assert ids[0] == tok.token_to_id(sentinel), "the sentinel is one added token"
        return ids[1:]

    def _literal_tokenizer(self, sentinel: str) -> tokenizers.Tokenizer:
        """A copy of the tokenizer with ``sentinel`` added, and every special token of the config special (so that
        ``encode_special_tokens`` leaves them all in the text)."""
        if sentinel not in self._literal_tokenizers:
            tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
            added = tok.get_added_tokens_decoder().values()
            tok.add_special_tokens(
                [
                    tokenizers.AddedToken(
                        t.content,
                        single_word=t.single_word,
                        lstrip=t.lstrip,
                        rstrip=t.rstrip,
                        normalized=t.normalized,
                        special=True,
                    )
                    for t in added
                    if t.content in self.cfg.special_tokens and not t.special
                ]
            )
            tok.add_tokens([tokenizers.AddedToken(sentinel, special=False, normalized=False)])
            self._literal_tokenizers[sentinel] = tok
        return self._literal_tokenizers[sentinel]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def _token_bytes(self) -> list[bytes]:
        """Each token's piece read as the decoder reads it (:class:`_PieceBytes`); an added token's text as it is."""
        pieces = _PieceBytes(json.loads(self._tok.to_str())["decoder"], self._path)
        added = {token_id: token.content for token_id, token in self._tok.get_added_tokens_decoder().items()}
        out = []
        for token_id in range(self.vocab_size):
            piece = self._tok.id_to_token(token_id)
            if token_id in added:
                out.append(added[token_id].encode())
            else:
                out.append(b"" if piece is None else pieces.bytes_of(piece))
        return out

    @property
    def control_ids(self) -> frozenset[int]:
        special = {token_id for token_id, token in self._tok.get_added_tokens_decoder().items() if token.special}
        return frozenset(special | set(self.cfg.special_tokens.values()))


_BYTE_PIECE = re.compile("<0x([0-9A-Fa-f]{2})>")


class _PieceBytes:
    """The bytes of a ``tokenizer.json`` vocabulary piece, read from its decoder: byte-level BPE writes every byte as
    a printable character (:func:`bytes_to_unicode`); SentencePiece-style vocabularies write a space as "▁" (a
    ``Metaspace`` decoder, or a ``Replace`` of it) and, with ``ByteFallback``, a lone byte as ``<0xNN>``. Other
    decoders (WordPiece's "##", a BPE word suffix) are refused: their pieces' bytes depend on their neighbours."""

    def __init__(self, decoder: dict[str, Any] | None, path: Path) -> None:
        steps = [] if decoder is None else decoder.get("decoders", [decoder])
        kinds = {step["type"] for step in steps}
        unknown = kinds - {"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"}
        if unknown:
            raise ValueError(f"{path}: its {', '.join(sorted(unknown))} decoder does not say each token's bytes")
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds
        self.replace = [(step["replacement"], " ") for step in steps if step["type"] == "Metaspace"]
        self.replace += [
            (step["pattern"]["String"], step["content"])
            for step in steps
            if step["type"] == "Replace" and "String" in step["pattern"]
        ]

    def bytes_of(self, piece: str) -> bytes:
        byte_of_char = _byte_of_char()
        if self.byte_level and all(char in byte_of_char for char in piece):
            return bytes(byte_of_char[char] for char in piece)
        byte = _BYTE_PIECE.fullmatch(piece) if self.byte_fallback else None
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        for pattern, content in self.replace:
            piece = piece.replace(pattern, content)
        return piece.encode()


_SENTINEL_CHAR = "\ufdd0"  # a Unicode noncharacter, kept for internal use: a run longer than any in the text
# White_Space and word characters, as the regex crate that ``tokenizers`` uses reads ``\s`` and ``\w``.
_WHITE_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(map(chr, range(0x2000, 0x200B)))


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


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The inverse of :func:`bytes_to_unicode`, made on first use."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _is_word_char(char: str) -> bool:
    category = unicodedata.category(char)
    return category[0] in "LM" or category in ("Nd", "Nl", "Pc") or char in "\u200c\u200d"


class _AddedTokens:
    """Where ``tokenizers`` cuts text at its added tokens (those matched in the raw text, not normalized):
    leftmost-longest matches, then each token's ``single_word``, ``lstrip`` and ``rstrip`` (as its
    ``AddedVocabulary::find_matches``). Matches of ``special`` tokens overlapping a literal span are skipped, as
    it skips special tokens when encoding with ``encode_special_tokens``."""

    def __init__(self, decoder: dict[int, tokenizers.AddedToken], special: set[str]) -> None:
        self._tokens = {t.content: (token_id, t) for token_id, t in decoder.items() if t.content and not t.normalized}
        self._special = special
        alternatives = "|".join(map(re.escape, sorted(self._tokens, key=len, reverse=True)))
        self._pattern = re.compile(alternatives) if alternatives else None

    def cuts(self, text: str, literal: Spans) -> Iterator[tuple[int, int, int]]:
        """``(start, end, id)`` of each added token ``tokenizers`` would cut out of ``text``, in order."""
        previous = 0
        for match in self._pattern.finditer(text) if self._pattern else ():
            token_id, token = self._tokens[match.group()]
            start, end = match.span()
            if (token.special or token.content in self._special) and literal.overlaps(start, end):
                continue
            if token.single_word and (
                (start > 0 and _is_word_char(text[start - 1])) or (end < len(text) and _is_word_char(text[end]))
            ):
                continue
            if token.lstrip:
                start = max(previous, len(text[:start].rstrip(_WHITE_SPACE)))
            if token.rstrip:
                end = len(text) - len(text[end:].lstrip(_WHITE_SPACE))
            yield start, end, token_id
            previous = end


def read_tokenizer_json(path: Path) -> tokenizers.Tokenizer:
    """A ``tokenizer.json`` that can encode plain text (see :func:`check_encodes_text`)."""
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a plain Exception for unreadable files
        raise ValueError(f"cannot read tokenizer file {path}: {err}") from None
    check_encodes_text(tok, str(path))
    return tok


def check_encodes_text(tok: tokenizers.Tokenizer, where: str) -> None:
    """ValueError naming ``where`` if the tokenizer's model gives no tokens, only its unknown token, or an error
    for :data:`PLAIN_TEXT_PROBE` (a WordPiece vocabulary without the words or without ``[UNK]``, an empty BPE)."""
    model = type(tok.model).__name__
    try:
        ids = tok.encode(PLAIN_TEXT_PROBE, add_special_tokens=False).ids
    except Exception as err:  # tokenizers' model errors are plain Exceptions
        raise ValueError(f"{where}: its {model} model cannot encode plain text: {err}") from None
    if not ids:
        raise ValueError(f"{where}: its {model} model gives no tokens for plain text ({PLAIN_TEXT_PROBE!r})")
    if set(ids) == {_unknown_id(tok)}:
        raise ValueError(
            f"{where}: its {model} model gives only its unknown token for plain text ({PLAIN_TEXT_PROBE!r})"
        )


def _unknown_id(tok: tokenizers.Tokenizer) -> int | None:
    if isinstance(tok.model, tokenizers.models.Unigram):
        return json.loads(tok.model.__getstate__()).get("unk_id")
    unk_token = getattr(tok.model, "unk_token", None)
    return tok.token_to_id(unk_token) if unk_token else None


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
