"""Runtime tokenizers against transformers' own tokenizer for the same files."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from gpt_fast.config import TokenizerConfig
from gpt_fast.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer, TiktokenTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def assert_same_as_transformers(ours, theirs, texts: list[str]) -> None:
    """Same ids with and without BOS, and the same decoded text with and without special tokens."""
    for text in texts:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, bos=False) == ids, text
        assert ours.encode(text) == theirs.encode(text), text
        with_bos = theirs.encode(text)
        assert ours.decode(with_bos) == theirs.decode(with_bos), text
        assert ours.decode(with_bos, skip_special=True) == theirs.decode(with_bos, skip_special_tokens=True), text


def sentencepiece_config(special_tokens: dict[str, int] | None = None) -> TokenizerConfig:
    specials = {"<unk>": 0, "<s>": 1, "</s>": 2, "<ctl>": 3, "<tool>": 4} if special_tokens is None else special_tokens
    return TokenizerConfig(
        kind="sentencepiece",
        file="tokenizer.model",
        bos_id=1,
        add_bos=True,
        stop_ids=(2,),
        bos_token="<s>",
        eos_token="</s>",
        special_tokens=specials,
    )


def test_sentencepiece_matches_transformers(sentencepiece_dir: Path, varied_texts: list[str]) -> None:
    """Text that starts with a space or "▁" gets no dummy prefix from transformers 5; we follow sentencepiece
    there (more in test_tokenizer_sentencepiece.py)."""
    import sentencepiece as spm

    ours = load_tokenizer(sentencepiece_dir, sentencepiece_config())
    theirs = transformers.AutoTokenizer.from_pretrained(str(sentencepiece_dir))
    assert isinstance(ours, SentencePieceTokenizer)
    departing = [text for text in varied_texts if text.startswith((" ", "\u2581"))]
    assert_same_as_transformers(ours, theirs, [text for text in varied_texts if text not in departing])
    sp = spm.SentencePieceProcessor(model_file=str(sentencepiece_dir / "tokenizer.model"))
    for text in departing:
        assert ours.encode(text, bos=False) == sp.encode(text) != theirs.encode(text, add_special_tokens=False), text
    assert ours.vocab_size == len(theirs) == 500


def test_sentencepiece_decode_round_trips(sentencepiece_dir: Path, varied_texts: list[str]) -> None:
    ours = load_tokenizer(sentencepiece_dir, sentencepiece_config())
    for text in varied_texts:
        if "\u2581" not in text:  # "▁" is a space
            assert ours.decode(ours.encode(text, bos=False)) == text


def test_huggingface_matches_transformers(byte_level_bpe_dir: Path, varied_texts: list[str]) -> None:
    tok = json.loads((byte_level_bpe_dir / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    cfg = TokenizerConfig(
        kind="huggingface",
        file="tokenizer.json",
        bos_id=specials["<|begin_of_text|>"],
        add_bos=True,
        stop_ids=(specials["<|eot_id|>"],),
        special_tokens=specials,
    )
    ours = load_tokenizer(byte_level_bpe_dir, cfg)
    theirs = transformers.AutoTokenizer.from_pretrained(str(byte_level_bpe_dir))
    assert isinstance(ours, HuggingFaceTokenizer)
    assert_same_as_transformers(ours, theirs, varied_texts)
    assert ours.vocab_size == len(theirs)
    for text in varied_texts:
        assert ours.decode(ours.encode(text, bos=False)) == text


def tiktoken_config(directory: Path, add_bos: bool = True) -> TokenizerConfig:
    added = json.loads((directory / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    specials = {entry["content"]: int(token_id) for token_id, entry in added.items()}
    return TokenizerConfig(
        kind="tiktoken",
        file="tokenizer.model",
        bos_id=specials["<|begin_of_text|>"],
        add_bos=add_bos,
        stop_ids=(specials["<|eot_id|>"],),
        special_tokens=specials,
        pattern=LLAMA3_PATTERN,
    )


def test_tiktoken_matches_transformers(tiktoken_dir: Path, varied_texts: list[str]) -> None:
    """transformers 5 reads a tiktoken-format tokenizer.model itself (its TikTokenConverter) when it is not a
    SentencePiece model; special tokens come from tokenizer_config.json's added_tokens_decoder."""
    ours = load_tokenizer(tiktoken_dir, tiktoken_config(tiktoken_dir))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tiktoken_dir))
    assert isinstance(ours, TiktokenTokenizer)
    assert_same_as_transformers(ours, theirs, varied_texts)
    assert ours.vocab_size == len(theirs)
    for text in varied_texts:
        assert ours.decode(ours.encode(text, bos=False)) == text


def test_tiktoken_matches_tiktoken_with_all_specials_allowed(tiktoken_dir: Path, varied_texts: list[str]) -> None:
    import tiktoken

    cfg = tiktoken_config(tiktoken_dir)
    ours = load_tokenizer(tiktoken_dir, cfg)
    ranks = {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in (tiktoken_dir / "tokenizer.model").read_text().splitlines())
    }
    encoding = tiktoken.Encoding(
        "reference", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=cfg.special_tokens
    )
    for text in varied_texts:
        assert ours.encode(text, bos=False) == encoding.encode(text, allowed_special="all"), text


def test_bos_is_added_only_when_asked_and_configured(tiktoken_dir: Path) -> None:
    with_bos = load_tokenizer(tiktoken_dir, tiktoken_config(tiktoken_dir))
    without = load_tokenizer(tiktoken_dir, tiktoken_config(tiktoken_dir, add_bos=False))
    plain = with_bos.encode("hello", bos=False)
    assert with_bos.encode("hello") == [with_bos.bos_id, *plain]
    assert without.encode("hello") == plain
    assert with_bos.stop_ids == (with_bos.cfg.special_tokens["<|eot_id|>"],)


def test_unknown_ids_are_left_out_of_decode(
    sentencepiece_dir: Path, byte_level_bpe_dir: Path, tiktoken_dir: Path
) -> None:
    json_cfg = TokenizerConfig(kind="huggingface", file="tokenizer.json", bos_id=None, add_bos=False, stop_ids=())
    for tok in (
        load_tokenizer(sentencepiece_dir, sentencepiece_config()),
        load_tokenizer(byte_level_bpe_dir, json_cfg),
        load_tokenizer(tiktoken_dir, tiktoken_config(tiktoken_dir)),
    ):
        ids = tok.encode("hello", bos=False)
        assert tok.decode([*ids, 10_000]) == "hello"


def test_missing_tokenizer_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.model"):
        load_tokenizer(tmp_path, sentencepiece_config())


@pytest.mark.parametrize("kind", ["sentencepiece", "tiktoken", "huggingface"])
def test_corrupt_tokenizer_file_is_a_value_error_naming_it(tmp_path: Path, kind: str) -> None:
    (tmp_path / "broken.bin").write_bytes(b"\x00\xffnot a tokenizer\n\x12\x34")
    cfg = TokenizerConfig(kind=kind, file="broken.bin", bos_id=None, add_bos=False, stop_ids=(), pattern=LLAMA3_PATTERN)
    with pytest.raises(ValueError, match="broken.bin"):
        load_tokenizer(tmp_path, cfg)
