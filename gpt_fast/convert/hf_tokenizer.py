"""The tokenizer of a Hugging Face checkpoint folder, for the converter: which tokenizer file it holds (decided
by content, not by name), its BOS/EOS/stop ids from the checkpoint's metadata, and its chat template."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers

from gpt_fast.convert.tokenizer_common import (
    CONTROL,
    LLAMA3_PATTERN,
    TOKENIZER_JSON,
    UNKNOWN,
    USER_DEFINED,
    with_template_stop_id,
)
from gpt_fast.model.config import TokenizerConfig
from gpt_fast.text.tokenizer import NotTiktokenError, read_sentencepiece_proto, read_tiktoken_ranks, read_tokenizer_json
from gpt_fast.util.fileio import read_json_object

TOKENIZER_MODEL = "tokenizer.model"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

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
    template_file = src / CHAT_TEMPLATE_FILE
    where = str(template_file) if template_file.is_file() else f"{src / 'tokenizer_config.json'}: chat_template"
    return with_template_stop_id(cfg, template, where), [path], template


class _HfMetadata:
    """The JSON files of a checkpoint that name its special tokens."""

    def __init__(self, src: Path, hf_config: dict) -> None:
        self.src = src
        self.config = hf_config
        self.tokenizer_config = _read_json(src / "tokenizer_config.json")
        self.special_tokens_map = _read_json(src / "special_tokens_map.json")
        self.generation_config = _read_json(src / "generation_config.json")
        _check_token_texts(self.tokenizer_config, src / "tokenizer_config.json")
        _check_token_texts(self.special_tokens_map, src / "special_tokens_map.json")
        _check_tokenizer_config(self.tokenizer_config, src / "tokenizer_config.json")
        _check_token_ids(self.generation_config, src / "generation_config.json")
        _check_token_ids(self.config, src / "config.json")

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
                if token_id is not None and token_id not in ids:
                    ids.append(token_id)
        return ids

    def added_tokens(self, special_only: bool) -> dict[str, int]:
        """tokenizer_config.json's ``added_tokens_decoder`` as ``{text: id}``."""
        decoder = self.tokenizer_config.get("added_tokens_decoder") or {}
        return {
            entry["content"]: int(token_id)
            for token_id, entry in decoder.items()
            if not (special_only and not entry.get("special", True))
        }


def _read_json(path: Path) -> dict:
    """An optional metadata file: {} when absent."""
    return read_json_object(path) if path.is_file() else {}


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_token_texts(data: dict, path: Path) -> None:
    """``bos_token``/``eos_token``: null, a string, or an AddedToken object whose ``content`` is a string."""
    for name in ("bos_token", "eos_token"):
        value = data.get(name)
        text = value.get("content") if isinstance(value, dict) else value
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{path}: {name} must be a string or an object with a string content, got {_short(value)}")


def _check_tokenizer_config(data: dict, path: Path) -> None:
    """The fields of tokenizer_config.json the converter reads besides the token texts: ``added_tokens_decoder``
    (an object of token id -> AddedToken object), ``add_bos_token`` and ``chat_template``."""
    decoder = data.get("added_tokens_decoder")
    if decoder is not None and not isinstance(decoder, dict):
        raise ValueError(f"{path}: added_tokens_decoder must be an object of token id -> token, got {_short(decoder)}")
    for key, entry in (decoder or {}).items():
        where = f"{path}: added_tokens_decoder[{key!r}]"
        if not (key.isdecimal() and key.isascii()):
            raise ValueError(f"{where}: the key must be a token id (a non-negative integer)")
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{where} must be an object with a string content, got {_short(entry)}")
        if not isinstance(entry.get("special", True), bool):
            raise ValueError(f"{where}.special must be true or false, got {_short(entry['special'])}")
    add_bos = data.get("add_bos_token")
    if add_bos is not None and not isinstance(add_bos, bool):
        raise ValueError(f"{path}: add_bos_token must be true or false, got {_short(add_bos)}")
    template = data.get("chat_template")
    named = isinstance(template, list) and all(
        isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)
        for entry in template
    )
    if template is not None and not isinstance(template, str) and not named:
        raise ValueError(
            f"{path}: chat_template must be a string or a list of {{name, template}} strings, got {_short(template)}"
        )


def _check_token_ids(data: dict, path: Path) -> None:
    """``bos_token_id``/``eos_token_id``: null, a token id (a non-negative integer) or a list of them."""
    for name in ("bos_token_id", "eos_token_id"):
        value = data.get(name)
        values = value if isinstance(value, list) else [value]
        if not all(v is None or _is_token_id(v) for v in values):
            raise ValueError(
                f"{path}: {name} must be a token id (a non-negative integer) or a list of them, got {_short(value)}"
            )


def _short(value: Any) -> str:
    """A JSON value as an error message quotes it: its repr, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _content(token: Any) -> str | None:
    """A token as tokenizer_config.json writes it: a string, or an AddedToken object with ``content``."""
    return token.get("content") if isinstance(token, dict) else token


def _special_ids(
    meta: _HfMetadata,
    to_id: TokenLookup,
    to_text: TextLookup,
    default_bos: int | None = None,
    default_eos: int | None = None,
) -> dict[str, Any]:
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
    tok = read_tokenizer_json(path)
    special_tokens = {**meta.added_tokens(special_only=True)}
    special_tokens.update({t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special})
    ids = _special_ids(meta, tok.token_to_id, tok.id_to_token)
    prepended = _prepended_by_post_processor(tok)
    if ids["bos_id"] is None and len(prepended) == 1:
        ids.update(bos_id=prepended[0], bos_token=tok.id_to_token(prepended[0]))
    add_bos = _add_bos(meta, ids["bos_id"] is not None and prepended == [ids["bos_id"]])
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
    except NotTiktokenError:
        return _sentencepiece_config(path, data, meta)
    return _tiktoken_config(path, ranks, meta)


def _sentencepiece_config(path: Path, data: bytes, meta: _HfMetadata) -> TokenizerConfig:
    """SentencePiece: control, unknown and user-defined pieces are matched whole in the text (as transformers
    does), BOS/EOS default to the model's own, and BOS is added unless tokenizer_config.json says otherwise. The
    normalizer (and so the dummy prefix and whitespace handling) is the model file's own, read at run time."""
    try:
        proto = read_sentencepiece_proto(path, data)
    except ValueError:
        raise ValueError(f"{path} is neither a SentencePiece model nor a tiktoken BPE file") from None
    pieces = [p.piece for p in proto.pieces]
    index = {piece: i for i, piece in reversed(list(enumerate(pieces)))}
    special_tokens = {p.piece: i for i, p in enumerate(proto.pieces) if p.type in (UNKNOWN, CONTROL, USER_DEFINED)}
    special_tokens.update(meta.added_tokens(special_only=False))

    def to_id(text: str) -> int | None:
        return special_tokens.get(text, index.get(text))

    def to_text(token_id: int) -> str | None:
        return pieces[token_id] if 0 <= token_id < len(pieces) else None

    spec = proto.trainer_spec
    ids = _special_ids(meta, to_id, to_text, _nonnegative(spec.bos_id), _nonnegative(spec.eos_id))
    add_bos = _add_bos(meta, ids["bos_id"] is not None)
    return TokenizerConfig(kind="sentencepiece", file=path.name, add_bos=add_bos, special_tokens=special_tokens, **ids)


def _tiktoken_config(path: Path, ranks: dict[bytes, int], meta: _HfMetadata) -> TokenizerConfig:
    """tiktoken: the special tokens are those of tokenizer_config.json's ``added_tokens_decoder`` past the BPE
    ranks; the pattern is Llama 3's. BOS is added unless tokenizer_config.json says otherwise."""
    added = meta.added_tokens(special_only=False)
    if not added:
        raise ValueError(
            f"{path} is a tiktoken BPE file, but {meta.src / 'tokenizer_config.json'} has no added_tokens_decoder "
            "naming its special tokens"
        )
    first_special = max(ranks.values()) + 1
    special_tokens = {text: token_id for text, token_id in added.items() if token_id >= first_special}
    by_id = {token_id: text for text, token_id in special_tokens.items()}
    ids = _special_ids(meta, special_tokens.get, by_id.get)
    add_bos = _add_bos(meta, ids["bos_id"] is not None)
    return TokenizerConfig(
        kind="tiktoken", file=path.name, add_bos=add_bos, special_tokens=special_tokens, pattern=LLAMA3_PATTERN, **ids
    )


def _add_bos(meta: _HfMetadata, default: bool) -> bool:
    """tokenizer_config.json's ``add_bos_token`` (checked to be a bool or null), else ``default``."""
    add_bos = meta.tokenizer_config.get("add_bos_token")
    return default if add_bos is None else add_bos


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
        return {entry["name"]: entry["template"] for entry in template}.get("default")
    return template
