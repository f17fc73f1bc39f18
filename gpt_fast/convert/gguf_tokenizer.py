"""The tokenizer of a GGUF file, for the converter: a ``tokenizer.json`` rebuilt from the file's metadata, giving
the ids transformers' own GGUF tokenizer loading gives, and the file's chat template."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import gguf
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from gpt_fast.convert.tokenizer_common import (
    CONTROL,
    LLAMA3_PATTERN,
    TOKENIZER_JSON,
    USER_DEFINED,
    with_template_stop_id,
)
from gpt_fast.model.config import TokenizerConfig
from gpt_fast.text.tokenizer import SPACE_MARK, bytes_to_unicode, check_encodes_text

# Pre-tokenizer regexes by ``tokenizer.ggml.pre``: the ones transformers knows. Other names fall back to the
# GPT-2 split of a plain byte-level pre-tokenizer, as in transformers.
_GGUF_LLAMA3_SPLIT = LLAMA3_PATTERN
_GGUF_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_SPLITS = {
    **dict.fromkeys(
        [
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ],
        _GGUF_LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _GGUF_QWEN2_SPLIT),
    "qwen35": _GGUF_QWEN35_SPLIT,
    "tekken": _GGUF_TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GGUF_GPT4O_SPLIT),
}


def tokenizer_from_gguf(reader: gguf.GGUFReader, out_dir: Path) -> tuple[TokenizerConfig, str | None]:
    """Write ``tokenizer.json`` for a GGUF file's tokenizer into ``out_dir``; return its config and the file's
    ``tokenizer.chat_template`` (None if absent).

    ``tokenizer.ggml.model`` "gpt2" is byte-level BPE with the file's merges; "llama" is SentencePiece-style BPE
    whose merges come from the token scores. Stop ids: EOS, the end-of-turn / end-of-message tokens the
    metadata names, and the one the chat template ends an assistant turn with.
    """
    check_tokenizer_metadata(reader)
    meta = _GgufTokenizerMetadata(reader)
    builders = {"gpt2": _gguf_byte_level, "llama": _gguf_sentencepiece}
    model = meta.get("model")
    if model not in builders:
        raise ValueError(
            f"unsupported GGUF tokenizer {model!r} (tokenizer.ggml.model); supported: {', '.join(builders)}"
        )
    tok = builders[model](meta)
    specials = _add_gguf_added_tokens(tok, meta, byte_level=model == "gpt2")
    check_encodes_text(tok, "the GGUF file's tokenizer (tokenizer.ggml.tokens)")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / TOKENIZER_JSON).write_text(
        tok.to_str(), encoding="utf-8"
    )  # the converter passes its staging folder
    bos_id, eos_id = meta.get("bos_token_id"), meta.get("eos_token_id")
    stop_ids = [i for i in dict.fromkeys([eos_id, meta.get("eot_token_id"), meta.get("eom_token_id")]) if i is not None]
    add_bos = meta.get("add_bos_token", model == "llama") and bos_id is not None
    cfg = TokenizerConfig(
        kind="huggingface",
        file=TOKENIZER_JSON,
        bos_id=bos_id,
        add_bos=add_bos,
        stop_ids=tuple(stop_ids),
        bos_token=meta.token_text(bos_id),
        eos_token=meta.token_text(eos_id),
        special_tokens=specials,
    )
    template = meta.get("chat_template", prefix="tokenizer.")
    return with_template_stop_id(cfg, template, "GGUF metadata tokenizer.chat_template"), template


def check_tokenizer_metadata(reader: gguf.GGUFReader) -> None:
    """Refuse ``tokenizer.*`` metadata of the wrong type or value, naming the key: strings where strings belong,
    arrays of the element type they must hold (strings for tokens and merges, each merge two tokens joined by a
    space), token ids that are integers inside the vocabulary, a boolean ``add_bos_token``, one score and one type
    per token. Nothing is guessed: the string "no" is not a boolean, 1.0 is not a token id."""
    for key, (shape, kind) in _TOKENIZER_KEYS.items():
        field = reader.get_field(key)
        if field is not None and not _has_types(field.types, shape):
            raise _wrong(key, field, kind)
    tokens = reader.get_field(_GGML + "tokens")
    if tokens is None:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
    count = len(tokens.data)
    for name in ("scores", "token_type"):
        field = reader.get_field(_GGML + name)
        if field is not None and len(field.data) != count:
            raise _wrong(_GGML + name, field, f"{_TOKENIZER_KEYS[_GGML + name][1]}, one per token ({count})")
    for name in _TOKEN_ID_KEYS:
        field = reader.get_field(_GGML + name)
        if field is not None and not 0 <= field.contents() < count:
            raise ValueError(
                f"GGUF metadata {_GGML}{name} {field.contents()} is outside the vocabulary of {count} tokens"
            )
    merges = reader.get_field(_GGML + "merges")
    for index, merge in enumerate([] if merges is None else merges.contents()):
        if " " not in merge:
            raise ValueError(f"GGUF metadata {_GGML}merges[{index}] {merge[:40]!r} is not two tokens joined by a space")


def _has_types(types: list[gguf.GGUFValueType], shape: tuple[bool, set[gguf.GGUFValueType]]) -> bool:
    """Whether a field's ``types`` (GGUFReader's: ``[ARRAY, element type]`` or ``[scalar type]``) fit ``shape``
    (is it an array, and of which element or scalar types)."""
    array, allowed = shape
    if array:
        return len(types) == 2 and types[0] == _V.ARRAY and types[1] in allowed
    return len(types) == 1 and types[0] in allowed


def _wrong(key: str, field: Any, kind: str) -> ValueError:
    types = "/".join(t.name for t in field.types)
    return ValueError(f"GGUF metadata {key} has the wrong type or value ({types}; it must be {kind})")


_GGML = "tokenizer.ggml."
_V = gguf.GGUFValueType
_INTEGERS = {_V.UINT8, _V.INT8, _V.UINT16, _V.INT16, _V.UINT32, _V.INT32, _V.UINT64, _V.INT64}
_NUMBERS = _INTEGERS | {_V.FLOAT32, _V.FLOAT64}
_TOKEN_ID_KEYS = tuple(f"{name}_token_id" for name in ("bos", "eos", "eot", "eom", "unknown", "padding"))
# key -> ((is it an array, the value or element types it may have), what the error message says it must be)
_TOKENIZER_KEYS: dict[str, tuple[tuple[bool, set[gguf.GGUFValueType]], str]] = {
    _GGML + "model": ((False, {_V.STRING}), "a string"),
    _GGML + "pre": ((False, {_V.STRING}), "a string"),
    _GGML + "tokens": ((True, {_V.STRING}), "an array of strings"),
    _GGML + "merges": ((True, {_V.STRING}), "an array of strings"),
    _GGML + "scores": ((True, _NUMBERS), "an array of numbers"),
    _GGML + "token_type": ((True, _INTEGERS), "an array of integers"),
    _GGML + "add_bos_token": ((False, {_V.BOOL}), "true or false"),
    "tokenizer.chat_template": ((False, {_V.STRING}), "a string"),
    **{_GGML + name: ((False, _INTEGERS), "a token id (an integer)") for name in _TOKEN_ID_KEYS},
}


class _GgufTokenizerMetadata:
    """The ``tokenizer.*`` metadata of a GGUF file."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, name: str, default: Any = None, prefix: str = "tokenizer.ggml.") -> Any:
        field = self._fields.get(prefix + name)
        return default if field is None else field.contents()

    @functools.cached_property
    def tokens(self) -> list[str]:
        tokens = self.get("tokens")
        if not tokens:
            raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
        return tokens

    def token_text(self, token_id: int | None) -> str | None:
        """The text of a token id :func:`check_tokenizer_metadata` found inside the vocabulary."""
        return None if token_id is None else self.tokens[token_id]


def _gguf_byte_level(meta: _GgufTokenizerMetadata) -> tokenizers.Tokenizer:
    """Byte-level BPE. Tokens not written in the byte alphabet are respelled into it, as transformers does."""
    to_char = bytes_to_unicode()
    alphabet = set(to_char.values())
    vocab = {
        token if set(token) <= alphabet else "".join(to_char[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(meta.tokens)
    }
    model = models.BPE(
        vocab=vocab,
        merges=_gguf_merges(meta),
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    tok = tokenizers.Tokenizer(model)
    split = _GGUF_PRE_SPLITS.get(meta.get("pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _gguf_sentencepiece(meta: _GgufTokenizerMetadata) -> tokenizers.Tokenizer:
    """SentencePiece-style BPE with byte fallback; "▁" goes before the start of the input (transformers' Llama
    tokenizer; it does not read ``tokenizer.ggml.add_space_prefix``, so neither do we)."""
    vocab = {token: index for index, token in enumerate(meta.tokens)}
    model = models.BPE(vocab=vocab, merges=_gguf_merges(meta), fuse_unk=True, byte_fallback=True, dropout=None)
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE_MARK, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tok


def _gguf_merges(meta: _GgufTokenizerMetadata) -> list[tuple[str, str]]:
    merges = meta.get("merges")
    if merges is not None:
        return [tuple(merge.split(" ", 1)) for merge in merges]
    scores = meta.get("scores")
    if scores is None:
        raise ValueError("the GGUF tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
    return merges_from_scores(meta.tokens, scores)


def merges_from_scores(tokens: list[str], scores: Iterable[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary (SentencePiece BPE): every split of a token into two tokens of
    the vocabulary, best score first, then longer left and right parts first; ties keep vocabulary order."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked: list[tuple[float, str, str]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        ranked.extend((score, left, right) for left, right in pairs)
    ranked.sort(key=lambda merge: (merge[0], len(merge[1]), len(merge[2])), reverse=True)
    return [(left, right) for _, left, right in ranked]


def _add_gguf_added_tokens(tok: tokenizers.Tokenizer, meta: _GgufTokenizerMetadata, byte_level: bool) -> dict[str, int]:
    """Add the control tokens (and BOS/EOS/UNK/PAD) as special tokens and the user-defined ones as plain added
    tokens, so that text holding them encodes them whole. Return the special ones as ``{text: id}``.

    In a byte-level vocabulary a control token not spelled in the byte alphabet is a mislabel and is skipped,
    as transformers does.
    """
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    types = meta.get("token_type") or []
    tokens = meta.tokens
    vocab = tok.get_vocab(with_added_tokens=False)
    control = [
        t
        for t, kind in zip(tokens, types, strict=False)
        if kind == CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    named = [meta.get(f"{name}_token_id") for name in ("bos", "eos", "unknown", "padding")]
    named_tokens = [tokens[i] for i in named if i is not None and 0 <= i < len(tokens) and vocab.get(tokens[i]) == i]
    special = list(dict.fromkeys(control + named_tokens))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in special])
    user = [
        t for t, kind in zip(tokens, types, strict=False) if kind == USER_DEFINED and t in vocab and t not in special
    ]
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in user])
    return {t: tok.token_to_id(t) for t in special}
