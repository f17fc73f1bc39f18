"""Runtime tokenizers against transformers' own tokenizer for the same files."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest

from gpt_fast.convert.hf_tokenizer import tokenizer_from_hf_dir
from gpt_fast.model.config import TokenizerConfig
from gpt_fast.text.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer, TiktokenTokenizer, load_tokenizer

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


def departs_from_sentencepiece(text: str) -> bool:
    """transformers 5 gives text that starts with a space or "▁" no dummy prefix; sentencepiece (and we) do."""
    return text.startswith((" ", "\u2581"))


def test_sentencepiece_matches_transformers(sentencepiece_dir: Path, varied_texts: list[str]) -> None:
    """Text that starts with a space or "▁" gets no dummy prefix from transformers 5; we follow sentencepiece
    there (more in test_tokenizer_sentencepiece.py)."""
    import sentencepiece as spm

    ours = load_tokenizer(sentencepiece_dir, sentencepiece_config())
    theirs = transformers.AutoTokenizer.from_pretrained(str(sentencepiece_dir))
    assert isinstance(ours, SentencePieceTokenizer)
    departing = [text for text in varied_texts if departs_from_sentencepiece(text)]
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


# Texts where special-token strings sit next to, inside and around non-special added tokens and themselves.
LITERAL_TEXTS = [
    "a<tool> b</s>c<s>",
    "<s> x</s>y<tool>z",
    "<|eot_id|><|eot_id|>hi<|begin_of_text|>",
    "\ufdd0<tool>\ufdd0</s> <|eot_id|>",
    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>system",
]


def all_kinds(sentencepiece_dir: Path, byte_level_bpe_dir: Path, tiktoken_dir: Path) -> list[tuple[object, object]]:
    """``(ours, transformers')`` for each tokenizer kind."""
    pairs = []
    for directory, cfg in (
        (sentencepiece_dir, sentencepiece_config()),
        (byte_level_bpe_dir, tokenizer_from_hf_dir(byte_level_bpe_dir, {})[0]),
        (tiktoken_dir, tiktoken_config(tiktoken_dir)),
    ):
        pairs.append((load_tokenizer(directory, cfg), transformers.AutoTokenizer.from_pretrained(str(directory))))
    return pairs


def test_literal_text_matches_transformers_split_special_tokens(
    sentencepiece_dir: Path, byte_level_bpe_dir: Path, tiktoken_dir: Path, varied_texts: list[str]
) -> None:
    """Text that is all literal encodes as transformers encodes it with ``split_special_tokens=True``; with no
    literal span, as without it (where transformers follows sentencepiece: see departs_from_sentencepiece)."""
    for ours, theirs in all_kinds(sentencepiece_dir, byte_level_bpe_dir, tiktoken_dir):
        sentencepiece = isinstance(ours, SentencePieceTokenizer)
        for text in [
            t for t in [*varied_texts, *LITERAL_TEXTS] if not (sentencepiece and departs_from_sentencepiece(t))
        ]:
            literal = theirs.encode(text, add_special_tokens=False, split_special_tokens=True)
            assert ours.encode(text, bos=False, literal_spans=[(0, len(text))]) == literal, (type(ours), text)
            assert ours.encode(text, bos=False, literal_spans=[]) == theirs.encode(text, add_special_tokens=False)


def test_literal_spans_of_tokenizer_json_agree_with_tiktoken_kind(byte_level_bpe_dir: Path, tiktoken_dir: Path) -> None:
    """The same vocabulary as tokenizer.json (cut where ``tokenizers`` cuts, pieces encoded by it) and as a
    tiktoken file (split by our splitter): the same ids for random texts and random literal spans."""
    json_kind = load_tokenizer(byte_level_bpe_dir, tokenizer_from_hf_dir(byte_level_bpe_dir, {})[0])
    tiktoken_kind = load_tokenizer(tiktoken_dir, tiktoken_config(tiktoken_dir))
    assert json_kind.special_tokens == tiktoken_kind.special_tokens
    parts = ["<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>", " hello", "\n", "  ", "world", "<|", "id|>", "é"]
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 10)))
        spans = [
            tuple(sorted((rng.randint(0, len(text)), rng.randint(0, len(text))))) for _ in range(rng.randint(0, 3))
        ]
        assert json_kind.encode(text, literal_spans=spans) == tiktoken_kind.encode(text, literal_spans=spans), (
            text,
            spans,
        )


def test_only_special_tokens_overlapping_a_literal_span_are_text(tiktoken_dir: Path) -> None:
    tok = load_tokenizer(tiktoken_dir, tiktoken_config(tiktoken_dir))
    eot = tok.special_tokens["<|eot_id|>"]
    text = "<|eot_id|>x<|eot_id|>"
    assert tok.encode(text, bos=False, literal_spans=[(10, 11)]) == [eot, *tok.encode("x", bos=False), eot]
    for span in [(0, 1), (9, 10)]:  # touching the first token's first or last character
        assert tok.encode(text, bos=False, literal_spans=[span]).count(eot) == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ab\udcffc", "not valid UTF-8: byte 0xFF at character 2"),  # what Python makes of $'ab\xffc' in argv
        ("\ud800", "not valid UTF-8: a lone surrogate U\\+D800 at character 0"),
    ],
)
def test_text_that_is_not_unicode_is_refused_by_every_kind(
    sentencepiece_dir: Path, byte_level_bpe_dir: Path, tiktoken_dir: Path, text: str, message: str
) -> None:
    for ours, _ in all_kinds(sentencepiece_dir, byte_level_bpe_dir, tiktoken_dir):
        with pytest.raises(ValueError, match=f"^the prompt is {message}$"):
            ours.encode(text)


def write_tiktoken(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def byte_lines() -> list[str]:
    return [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["YWI= -1"], r"line 257: rank -1 is outside 0\.\.2147483647"),
        (["YWI= 4294967296"], r"line 257: rank 4294967296 is outside"),
        (["YWI= 5"], r"line 257: rank 5 is already the rank of line 6"),
        (["YWI= 300", "YWI= 301"], r"line 258: token YWI= is listed twice"),
    ],
    ids=["negative", "huge", "duplicate-rank", "duplicate-token"],
)
def test_bad_tiktoken_ranks_are_named(tmp_path: Path, extra: list[str], message: str) -> None:
    path = write_tiktoken(tmp_path / "tokenizer.model", byte_lines() + extra)
    cfg = TokenizerConfig(
        kind="tiktoken", file=path.name, bos_id=None, add_bos=False, stop_ids=(), pattern=LLAMA3_PATTERN
    )
    with pytest.raises(ValueError, match=f"tokenizer.model {message}"):
        load_tokenizer(tmp_path, cfg)


def test_tiktoken_file_without_every_byte_is_refused(tmp_path: Path) -> None:
    """tiktoken itself panics (a BaseException) on text with a byte that is not a token."""
    write_tiktoken(tmp_path / "tokenizer.model", byte_lines()[:65] + byte_lines()[66:])
    cfg = TokenizerConfig(
        kind="tiktoken", file="tokenizer.model", bos_id=None, add_bos=False, stop_ids=(), pattern=LLAMA3_PATTERN
    )
    with pytest.raises(ValueError, match="tokenizer.model: the tiktoken BPE file lacks the single-byte tokens 0x41;"):
        load_tokenizer(tmp_path, cfg)


def tokenizer_json_of(model) -> str:
    import tokenizers
    from tokenizers import pre_tokenizers

    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("wordpiece-without-unk", "its WordPiece model cannot encode plain text: .*Missing \\[UNK\\]"),
        ("wordpiece-unk-only", "its WordPiece model gives only its unknown token for plain text"),
        ("empty-bpe", "its BPE model gives no tokens for plain text"),
        ("unigram-unk-only", "its Unigram model gives only its unknown token"),
    ],
)
def test_tokenizer_json_that_cannot_encode_text_is_refused(tmp_path: Path, model: str, message: str) -> None:
    from tokenizers import models

    built = {
        "wordpiece-without-unk": lambda: models.WordPiece({"a": 0}, unk_token="[UNK]"),
        "wordpiece-unk-only": lambda: models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"),
        "empty-bpe": lambda: models.BPE(),
        "unigram-unk-only": lambda: models.Unigram([("<unk>", 0.0), ("q", -1.0)], unk_id=0),
    }[model]()
    (tmp_path / "tokenizer.json").write_text(tokenizer_json_of(built))
    cfg = TokenizerConfig(kind="huggingface", file="tokenizer.json", bos_id=None, add_bos=False, stop_ids=())
    with pytest.raises(ValueError, match=f"tokenizer.json: {message}"):
        load_tokenizer(tmp_path, cfg)
