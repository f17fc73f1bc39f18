"""Pick a checkpoint's tokenizer and its special tokens, for the converters.

From a Hugging Face checkpoint folder: which tokenizer file it holds (decided by content, not by name) and its
BOS/EOS/stop ids from the checkpoint's metadata. From a GGUF file: a ``tokenizer.json`` rebuilt from the metadata,
giving the ids transformers' own GGUF tokenizer loading gives.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import gguf
import jinja2
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from gpt_fast.chat import render_chat
from gpt_fast.config import TokenizerConfig
from gpt_fast.fileio import read_json_object
from gpt_fast.tokenizer import SPACE_MARK, read_sentencepiece_proto, read_tiktoken_ranks

# The pre-tokenizer regex of Meta's Llama 3 tiktoken tokenizer: the default for tiktoken-format files.
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_MODEL = "tokenizer.model"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

_TEMPLATE_PROBE = "Probe reply 7341."  # assistant text rendered to find what a chat template writes after it

# SentencePiece piece types (sentencepiece_model.proto) and GGUF token types share these numbers.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

TokenLookup = Callable[[str], "int | None"]
TextLookup = Callable[[int], "str | None"]


def tokenizer_from_hf_dir(src: Path, hf_config: dict) -> tuple[TokenizerConfig, list[Path], str | None]:
    """The tokenizer of a Hugging Face checkpoint folder: its config, the files to copy next to the converted
    weights (``config.file`` is the name of one of them), and the chat template (None if it has none).

    ``tokenizer.json`` is preferred; otherwise ``tokenizer.model`` or ``original/tokenizer.model``, read as a
    SentencePiece model or a tiktoken BPE file according to what the file holds. The stop ids gain the token the
    chat template ends an assistant turn with (see :func:`with_template_stop_id`).
    """
    src = Path(src)
    meta = _HfMetadata(src, hf_config)
    if (src / TOKENIZER_JSON).is_file():
        cfg, path = _from_tokenizer_json(src / TOKENIZER_JSON, meta), src / TOKENIZER_JSON
    else:
        candidates = [src / TOKENIZER_MODEL, src / "original" / TOKENIZER_MODEL]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            looked = ", ".join(str(p) for p in [src / TOKENIZER_JSON, *candidates])
            raise FileNotFoundError(f"no tokenizer in {src}: looked for {looked}")
        cfg = _from_tokenizer_model(path, meta)
    template = _hf_chat_template(src, meta.tokenizer_config)
    return with_template_stop_id(cfg, template), [path], template


class _HfMetadata:
    """The JSON files of a checkpoint that name its special tokens."""

    def __init__(self, src: Path, hf_config: dict) -> None:
        self.src = src
        self.config = hf_config
        self.tokenizer_config = _read_json(src / "tokenizer_config.json")
        self.special_tokens_map = _read_json(src / "special_tokens_map.json")
        self.generation_config = _read_json(src / "generation_config.json")

    def token_text(self, name: str) -> tuple[bool, str | None]:
        """``(given, text)`` of ``bos_token``/``eos_token`` in tokenizer_config.json or special_tokens_map.json."""
        for source in (self.tokenizer_config, self.special_tokens_map):
            if name in source:
                return True, _content(source[name])
        return False, None

    def token_ids(self, name: str) -> list[int]:
        """``bos_token_id``/``eos_token_id`` (an int or a list) from generation_config.json, then config.json."""
        ids: list[int] = []
        for source in (self.generation_config, self.config):
            value = source.get(name)
            for token_id in value if isinstance(value, list) else [value]:
                if isinstance(token_id, int) and not isinstance(token_id, bool) and token_id not in ids:
                    ids.append(token_id)
        return ids

    def added_tokens(self, special_only: bool) -> dict[str, int]:
        """tokenizer_config.json's ``added_tokens_decoder`` as ``{text: id}``."""
        decoder = self.tokenizer_config.get("added_tokens_decoder") or {}
        return {
            _content(entry): int(token_id)
            for token_id, entry in decoder.items()
            if not (special_only and isinstance(entry, dict) and not entry.get("special", True))
        }


def _read_json(path: Path) -> dict:
    """An optional metadata file: {} when absent."""
    return read_json_object(path) if path.is_file() else {}


def _content(token: Any) -> str | None:
    """A token as tokenizer_config.json writes it: a string, or an AddedToken object with ``content``."""
    return token.get("content") if isinstance(token, dict) else token


def _special_ids(meta: _HfMetadata, to_id: TokenLookup, to_text: TextLookup, default_bos: int | None = None, default_eos: int | None = None) -> dict[str, Any]:
    """BOS and stop tokens from the checkpoint's metadata.

    BOS: the tokenizer's ``bos_token``, else ``bos_token_id`` from generation_config.json / config.json, else
    ``default_bos``. Stop ids: every ``eos_token_id`` of generation_config.json and config.json, plus the
    tokenizer's ``eos_token``, else ``default_eos``.
    """
    bos_given, bos_token = meta.token_text("bos_token")
    bos_id = to_id(bos_token) if bos_token else None
    if bos_id is None and (bos_token is not None or not bos_given):  # no BOS text, or one the vocabulary lacks
        bos_id = next(iter(meta.token_ids("bos_token_id")), default_bos)
        bos_token = to_text(bos_id) if bos_id is not None else None
    eos_given, eos_token = meta.token_text("eos_token")
    stop_ids = meta.token_ids("eos_token_id")
    eos_id = to_id(eos_token) if eos_token else None
    if eos_id is not None and eos_id not in stop_ids:
        stop_ids.append(eos_id)
    if not stop_ids and default_eos is not None:
        stop_ids.append(default_eos)
    if eos_token is None and not eos_given and stop_ids:
        eos_token = to_text(stop_ids[0])
    return {"bos_id": bos_id, "bos_token": bos_token, "stop_ids": tuple(stop_ids), "eos_token": eos_token}


def _from_tokenizer_json(path: Path, meta: _HfMetadata) -> TokenizerConfig:
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a plain Exception for unreadable files
        raise ValueError(f"cannot read tokenizer file {path}: {err}") from None
    special_tokens = {**meta.added_tokens(special_only=True)}
    special_tokens.update({t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special})
    ids = _special_ids(meta, tok.token_to_id, tok.id_to_token)
    prepended = _prepended_by_post_processor(tok)
    if ids["bos_id"] is None and len(prepended) == 1:
        ids.update(bos_id=prepended[0], bos_token=tok.id_to_token(prepended[0]))
    add_bos = meta.tokenizer_config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = ids["bos_id"] is not None and prepended == [ids["bos_id"]]
    return TokenizerConfig(kind="huggingface", file=path.name, add_bos=add_bos, special_tokens=special_tokens, **ids)


def _prepended_by_post_processor(tok: tokenizers.Tokenizer) -> list[int]:
    """The ids the tokenizer's post-processor puts before the text when encoding with special tokens."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def _from_tokenizer_model(path: Path, meta: _HfMetadata) -> TokenizerConfig:
    data = path.read_bytes()
    try:
        ranks = read_tiktoken_ranks(path, data)
    except ValueError:
        return _sentencepiece_config(path, data, meta)
    return _tiktoken_config(path, ranks, meta)


def _sentencepiece_config(path: Path, data: bytes, meta: _HfMetadata) -> TokenizerConfig:
    """SentencePiece: control, unknown and user-defined pieces are matched whole in the text (as transformers
    does), BOS/EOS default to the model's own, and BOS is added unless tokenizer_config.json says otherwise."""
    try:
        proto = read_sentencepiece_proto(path, data)
    except ValueError:
        raise ValueError(f"{path} is neither a SentencePiece model nor a tiktoken BPE file") from None
    pieces = [p.piece for p in proto.pieces]
    index = {piece: i for i, piece in reversed(list(enumerate(pieces)))}
    special_tokens = {p.piece: i for i, p in enumerate(proto.pieces) if p.type in (_UNKNOWN, _CONTROL, _USER_DEFINED)}
    special_tokens.update(meta.added_tokens(special_only=False))

    def to_id(text: str) -> int | None:
        return special_tokens.get(text, index.get(text))

    def to_text(token_id: int) -> str | None:
        return pieces[token_id] if 0 <= token_id < len(pieces) else None

    spec = proto.trainer_spec
    ids = _special_ids(meta, to_id, to_text, _nonnegative(spec.bos_id), _nonnegative(spec.eos_id))
    add_bos = meta.tokenizer_config.get("add_bos_token", ids["bos_id"] is not None)
    return TokenizerConfig(kind="sentencepiece", file=path.name, add_bos=add_bos, special_tokens=special_tokens, **ids)


def _tiktoken_config(path: Path, ranks: dict[bytes, int], meta: _HfMetadata) -> TokenizerConfig:
    """tiktoken: the special tokens are those of tokenizer_config.json's ``added_tokens_decoder`` past the BPE
    ranks; the pattern is Llama 3's. BOS is added unless tokenizer_config.json says otherwise."""
    added = meta.added_tokens(special_only=False)
    if not added:
        raise ValueError(f"{path} is a tiktoken BPE file, but {meta.src / 'tokenizer_config.json'} has no added_tokens_decoder naming its special tokens")
    first_special = max(ranks.values()) + 1
    special_tokens = {text: token_id for text, token_id in added.items() if token_id >= first_special}
    by_id = {token_id: text for text, token_id in special_tokens.items()}
    ids = _special_ids(meta, special_tokens.get, by_id.get)
    add_bos = meta.tokenizer_config.get("add_bos_token", ids["bos_id"] is not None)
    return TokenizerConfig(kind="tiktoken", file=path.name, add_bos=add_bos, special_tokens=special_tokens, pattern=LLAMA3_PATTERN, **ids)


def with_template_stop_id(cfg: TokenizerConfig, template: str | None) -> TokenizerConfig:
    """``cfg`` with the special token the chat template writes right after an assistant message added to its
    stop ids (an end-of-turn token such as Llama 3's, which a checkpoint's EOS metadata does not always list).

    Found by rendering a short conversation, so it depends on what the template writes, not on token names.
    """
    if not template:
        return cfg
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _TEMPLATE_PROBE}]
    try:
        text = render_chat(template, messages, bos_token=cfg.bos_token, eos_token=cfg.eos_token, add_generation_prompt=False)
    except (jinja2.TemplateError, TypeError, ValueError, LookupError):  # a template that rejects the probe
        return cfg
    _, found, after = text.rpartition(_TEMPLATE_PROBE)
    after = after.lstrip()
    token = next((t for t in sorted(cfg.special_tokens, key=len, reverse=True) if t and after.startswith(t)), None)
    if not found or token is None or cfg.special_tokens[token] in cfg.stop_ids:
        return cfg
    return dataclasses.replace(cfg, stop_ids=(*cfg.stop_ids, cfg.special_tokens[token]))


def _nonnegative(token_id: int) -> int | None:
    return token_id if token_id >= 0 else None


def _hf_chat_template(src: Path, tokenizer_config: dict) -> str | None:
    """``chat_template.jinja`` if present (transformers gives it priority), else tokenizer_config.json's
    ``chat_template``: a string, or a list of ``{name, template}`` of which the "default" one is taken."""
    template_file = src / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


# --- GGUF ---------------------------------------------------------------------------------------------------

# Pre-tokenizer regexes by ``tokenizer.ggml.pre``: the ones transformers knows. Other names fall back to the
# GPT-2 split of a plain byte-level pre-tokenizer, as in transformers.
_GGUF_LLAMA3_SPLIT = LLAMA3_PATTERN
_GGUF_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GGUF_QWEN35_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
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
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"], _GGUF_LLAMA3_SPLIT),
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
    meta = _GgufTokenizerMetadata(reader)
    builders = {"gpt2": _gguf_byte_level, "llama": _gguf_sentencepiece}
    model = meta.get("model")
    if model not in builders:
        raise ValueError(f"unsupported GGUF tokenizer {model!r} (tokenizer.ggml.model); supported: {', '.join(builders)}")
    tok = builders[model](meta)
    specials = _add_gguf_added_tokens(tok, meta, byte_level=model == "gpt2")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / TOKENIZER_JSON).write_text(tok.to_str(), encoding="utf-8")  # the converter passes its staging folder
    bos_id, eos_id = meta.get("bos_token_id"), meta.get("eos_token_id")
    stop_ids = [i for i in dict.fromkeys([eos_id, meta.get("eot_token_id"), meta.get("eom_token_id")]) if i is not None]
    add_bos = meta.get("add_bos_token", model == "llama") and bos_id is not None
    cfg = TokenizerConfig(
        kind="huggingface",
        file=TOKENIZER_JSON,
        bos_id=bos_id,
        add_bos=add_bos,
        stop_ids=tuple(stop_ids),
        bos_token=meta.token_text(bos_id, "bos_token_id"),
        eos_token=meta.token_text(eos_id, "eos_token_id"),
        special_tokens=specials,
    )
    template = meta.get("chat_template", prefix="tokenizer.")
    return with_template_stop_id(cfg, template), template


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

    def token_text(self, token_id: int | None, key: str) -> str | None:
        if token_id is None:
            return None
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"tokenizer.ggml.{key} {token_id} is outside the vocabulary of {len(self.tokens)} tokens")
        return self.tokens[token_id]


def _gguf_byte_level(meta: _GgufTokenizerMetadata) -> tokenizers.Tokenizer:
    """Byte-level BPE. Tokens not written in the byte alphabet are respelled into it, as transformers does."""
    to_char = bytes_to_unicode()
    alphabet = set(to_char.values())
    vocab = {
        token if set(token) <= alphabet else "".join(to_char[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(meta.tokens)
    }
    model = models.BPE(vocab=vocab, merges=_gguf_merges(meta), dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    tok = tokenizers.Tokenizer(model)
    split = _GGUF_PRE_SPLITS.get(meta.get("pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
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
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
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
    for token, score in dict(zip(tokens, scores)).items():
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
    control = [t for t, kind in zip(tokens, types) if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    named = [meta.get(f"{name}_token_id") for name in ("bos", "eos", "unknown", "padding")]
    named_tokens = [tokens[i] for i in named if i is not None and 0 <= i < len(tokens) and vocab.get(tokens[i]) == i]
    special = list(dict.fromkeys(control + named_tokens))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in special])
    user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab and t not in special]
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in user])
    return {t: tok.token_to_id(t) for t in special}


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
