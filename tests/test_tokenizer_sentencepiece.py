"""SentencePiece models against sentencepiece itself, for every normalizer setting found in the wild.

Each tiny model is trained once per test run (in milliseconds). The reference is sentencepiece's own ``encode`` and
``decode`` of the unmodified model file: that is how the models were trained and how Meta's and open_llama's code
tokenize. At special-token boundaries the reference is sentencepiece's handling of a user-defined symbol, which it
matches in the text as an opaque piece, less the dummy prefix transformers never puts next to a special token.
transformers 5 is compared where it agrees with sentencepiece; where it departs, the departure is recorded below.
"""

from __future__ import annotations

import io
import itertools
import json
import random
from pathlib import Path
from typing import NamedTuple

import pytest
import sentencepiece as spm
from tiny import hf_greedy, hf_llama_config, our_greedy, random_llama

from gpt_fast.convert.hf import convert_hf
from gpt_fast.convert.hf_tokenizer import tokenizer_from_hf_dir
from gpt_fast.engine.engine import Engine
from gpt_fast.text.tokenizer import SentencePieceTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

SYMBOL, CONTROL = "<tool>", "<ctl>"  # a user-defined symbol (sentencepiece matches it in text) and a control piece
_WORDS = (
    "the quick brown fox jumps over a lazy dog Hello hello world The capital of France is Paris def return print "
    "[INST] hi there again [/INST] "
    "café naïve über straße 数据 模型 東京 Привет мир 😀 🚀 👍🏽 👨‍👩‍👧 🇫🇷 x = y + 1 ( ) : , . ! ? — “ ” … "
    "0 1 2 3 4 5 6 7 8 9 3.14159 2024-06-01 # ** square"
).split()
PLAIN_TEXTS = [
    "The capital of France is",
    "Hello world",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "runs  of   spaces",
    "",
    " ",
    "   ",
    "\n",
    "\t",
    "line\nbreaks\n\nand\r\nCRLF",
    "tabs\tand\t\ttabs",
    "  \t mixed \n whitespace \t ",
    "café naïve über straße — “quotes” …",
    "数据模型 東京 Привет мир",
    "emoji 😀🚀 👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "ｆｕｌｌ ｗｉｄｔｈ ﬁ ① ㎏ x\u3000y \u00a0nbsp \u200bzwsp",
    "def f(x):\n    return x ** 2  # square",
    "digits 0123456789 3.14159 2024-06-01",
    "unknown Ω ẞ ✓",
    "▁already▁marked text",
    "marked at the end▁ ",
]
# Text around a user-defined symbol (not at the start: there sentencepiece puts the dummy prefix before it).
AROUND_SYMBOL = [
    f"x{SYMBOL}y",
    f"call {SYMBOL} now",
    f"a  {SYMBOL}  b  ",
    f"tab\t{SYMBOL}\nnewline",
    f"end {SYMBOL}",
    f"end {SYMBOL}   ",
    f"two{SYMBOL}{SYMBOL} in a row",
    f"spaces  {SYMBOL}   {SYMBOL}  between",
    f"ｆｕｌｌ{SYMBOL}\u3000ｗｉｄｔｈ",
]
# Single-spaced, normalizer-stable text whose characters are all in the vocabulary: transformers 5 agrees with
# sentencepiece on these for BPE models with the dummy prefix, whatever their normalizer.
AGREED_TEXTS = [
    "The capital of France is",
    "Hello world",
    "café naïve über straße",
    "数据模型 東京 Привет мир",
    "emoji 😀🚀 👍🏽",
    "digits 0123456789 3.14159",
    "<s>hello world</s>",
    "<s> hello </s> again",
    "<s>[INST] hi [/INST]",
    f"hi{CONTROL}there",
    f"x {SYMBOL} y",
    f"{SYMBOL}x",
    "</s>",
]


class Settings(NamedTuple):
    """How a tiny model is trained: BPE models are Llama-like (digits split, whitespace-only pieces), unigram
    models keep sentencepiece's defaults for those two."""

    model_type: str
    normalizer: str
    remove_extra_whitespaces: bool
    add_dummy_prefix: bool
    byte_fallback: bool

    def __str__(self) -> str:
        flags = zip(("rew", "prefix", "bytes"), self[2:], strict=True)
        return "-".join([self.model_type, self.normalizer, *(name for name, on in flags if on)])


MATRIX = [
    Settings(*combo)
    for combo in itertools.product(("bpe", "unigram"), ("identity", "nmt_nfkc", "nfkc"), *[(False, True)] * 3)
]
OPEN_LLAMA = Settings("bpe", "nmt_nfkc", remove_extra_whitespaces=True, add_dummy_prefix=True, byte_fallback=True)
LLAMA_2 = Settings("bpe", "identity", remove_extra_whitespaces=False, add_dummy_prefix=True, byte_fallback=True)


def _corpus(lines: int = 600) -> list[str]:
    rng = random.Random(0)
    seps = [" ", " ", " ", "  ", "\t", "\n", "    "]
    return [rng.choice(seps).join(rng.choices(_WORDS, k=rng.randint(3, 12))) for _ in range(lines)]


def _train(folder: Path, settings: Settings) -> Path:
    model = io.BytesIO()
    llama_like = settings.model_type == "bpe"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()),
        model_writer=model,
        model_type=settings.model_type,
        vocab_size=600,
        hard_vocab_limit=False,
        character_coverage=1.0,
        normalization_rule_name=settings.normalizer,
        remove_extra_whitespaces=settings.remove_extra_whitespaces,
        add_dummy_prefix=settings.add_dummy_prefix,
        byte_fallback=settings.byte_fallback,
        split_digits=llama_like,
        allow_whitespace_only_pieces=llama_like,
        user_defined_symbols=[SYMBOL],
        control_symbols=[CONTROL],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    folder.mkdir(parents=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True, "legacy": False}))
    return folder


class Trained:
    """A trained model's folder, sentencepiece's processor for it, ours (configured by the converter), and
    transformers' tokenizer (loaded when first asked for)."""

    def __init__(self, folder: Path, settings: Settings) -> None:
        self.folder, self.settings = folder, settings
        self.sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        cfg, _, _ = tokenizer_from_hf_dir(folder, {})
        self.ours = load_tokenizer(folder, cfg)
        assert isinstance(self.ours, SentencePieceTokenizer)
        self._theirs = None

    @property
    def theirs(self):
        if self._theirs is None:
            self._theirs = transformers.AutoTokenizer.from_pretrained(str(self.folder))
        return self._theirs

    def encode(self, text: str) -> list[int]:
        return self.ours.encode(text, bos=False)

    def sp_after_symbol(self, text: str) -> list[int]:
        """sentencepiece's ids for ``text`` where it follows a user-defined symbol."""
        ids = self.sp.encode(f"x{SYMBOL}{text}")
        return ids[ids.index(self.sp.piece_to_id(SYMBOL)) + 1 :]

    def sp_before_symbol(self, text: str) -> list[int]:
        """sentencepiece's ids for ``text`` where it starts the input and a user-defined symbol follows it."""
        ids = self.sp.encode(f"{text}{SYMBOL}x")
        return ids[: ids.index(self.sp.piece_to_id(SYMBOL))]


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """``trained(settings)``: the tiny model for ``settings``, trained on first use in the test run."""
    models: dict[Settings, Trained] = {}

    def get(settings: Settings) -> Trained:
        if settings not in models:
            models[settings] = Trained(_train(tmp_path_factory.mktemp("spm") / str(settings), settings), settings)
        return models[settings]

    return get


@pytest.fixture(params=MATRIX, ids=str)
def model(request, trained) -> Trained:
    return trained(request.param)


def test_text_is_encoded_as_sentencepiece_encodes_it(model: Trained) -> None:
    for text in PLAIN_TEXTS:
        expected = model.sp.encode(text)
        assert model.encode(text) == expected, text
        assert model.ours.encode(text) == [model.sp.bos_id(), *expected], text


def test_text_around_a_user_defined_symbol_is_encoded_as_sentencepiece_encodes_it(model: Trained) -> None:
    for text in AROUND_SYMBOL:
        assert model.encode(text) == model.sp.encode(text), text


@pytest.mark.parametrize("special", [SYMBOL, CONTROL, "<s>", "</s>"])
def test_special_tokens_are_boundaries_as_sentencepiece_makes_a_user_defined_symbol(
    model: Trained, special: str
) -> None:
    """Text after any special token is encoded as sentencepiece encodes it after a user-defined symbol (no dummy
    prefix; spaces there are text: one "▁" for a run of them when extra whitespace is removed); text before one
    likewise, with the dummy prefix when it starts the input. Whitespace alone before a special token at the
    start of the input gets no dummy prefix either (transformers never puts one next to a special token)."""
    special_id = model.ours.cfg.special_tokens[special]
    symbol_id = model.sp.piece_to_id(SYMBOL)
    for text in PLAIN_TEXTS:
        assert model.encode(special + text) == [special_id, *model.sp_after_symbol(text)], text
        between = [special_id if i == symbol_id else i for i in model.sp.encode(f"x{SYMBOL}{text}{SYMBOL}x")]
        assert model.encode(f"x{special}{text}{special}x") == between, text
        if model.sp.encode(text):
            assert model.encode(text + special) == [*model.sp_before_symbol(text), special_id], text
        else:  # empty, or whitespace that sentencepiece removes: the dummy prefix alone would be left
            assert model.encode(text + special) == [special_id], text


@pytest.mark.parametrize(
    "settings",
    [s for s in MATRIX if s.model_type == "bpe" and s.add_dummy_prefix],
    ids=str,
)
def test_matches_transformers_where_they_agree(trained, settings: Settings) -> None:
    model = trained(settings)
    for text in AGREED_TEXTS:
        ids = model.theirs.encode(text, add_special_tokens=False)
        assert model.encode(text) == ids, text
        assert model.ours.encode(text) == model.theirs.encode(text), text
        with_bos = model.theirs.encode(text)
        assert model.ours.decode(with_bos) == model.theirs.decode(with_bos), text
        assert model.ours.decode(with_bos, skip_special=True) == model.theirs.decode(with_bos, skip_special_tokens=True)


# Where transformers 5 (LlamaTokenizer: BPE merges derived from the vocabulary, no normalizer, "▁" prepended to
# the first piece of text unless it starts with one) gives other ids than sentencepiece. We follow sentencepiece.
DEPARTURES = {
    "leading space: no dummy prefix before it": (LLAMA_2, [" leading space", "   three", " ", "▁already▁marked"]),
    "nfkc normalizer ignored": (LLAMA_2._replace(normalizer="nfkc"), ["ｆｕｌｌ ｗｉｄｔｈ", "ﬁ ① ㎏"]),
    "nmt_nfkc normalizer ignored": (LLAMA_2._replace(normalizer="nmt_nfkc"), ["tabs\tand\nlines", "x\u3000y"]),
    "remove_extra_whitespaces ignored": (
        LLAMA_2._replace(remove_extra_whitespaces=True),
        ["runs  of   spaces", "trailing ", "  leading"],
    ),
    "add_dummy_prefix=false ignored": (LLAMA_2._replace(add_dummy_prefix=False), ["Hello world", "x"]),
    "no byte pieces: unknown characters dropped, not <unk>": (LLAMA_2._replace(byte_fallback=False), ["Ω", "a ẞ b"]),
}


@pytest.mark.parametrize("departure", list(DEPARTURES))
def test_where_transformers_departs_we_follow_sentencepiece(trained, departure: str) -> None:
    settings, texts = DEPARTURES[departure]
    model = trained(settings)
    for text in texts:
        expected = model.sp.encode(text)
        assert model.encode(text) == expected, text
        assert model.theirs.encode(text, add_special_tokens=False) != expected, f"transformers agrees now: {text!r}"


def test_unigram_models_are_segmented_as_sentencepiece_segments_them_not_by_bpe_merges(trained) -> None:
    """transformers 5 segments a unigram model with BPE merges derived from its vocabulary."""
    model = trained(LLAMA_2._replace(model_type="unigram"))
    texts = [text for text in AGREED_TEXTS if "<" not in text]
    for text in texts:
        assert model.encode(text) == model.sp.encode(text), text
    assert any(model.theirs.encode(text, add_special_tokens=False) != model.sp.encode(text) for text in texts)


def test_decode_matches_sentencepiece(model: Trained) -> None:
    """On the ids of every text, and on random ids (byte pieces that are not UTF-8, pieces of spaces first): the
    same text as sentencepiece, which writes control pieces as nothing and <unk> as " ⁇ " where we write them
    out, so those are left out here."""
    written = [i for i in range(model.sp.get_piece_size()) if not (model.sp.is_control(i) or model.sp.is_unknown(i))]
    spaces = [i for i in written if set(model.sp.id_to_piece(i)) == {"\u2581"}]
    rng = random.Random(0)
    samples = [rng.choices(spaces, k=rng.randint(0, 2)) + rng.choices(written, k=rng.randint(0, 8)) for _ in range(200)]
    samples += [[i for i in model.sp.encode(text) if i in written] for text in PLAIN_TEXTS + AROUND_SYMBOL]
    for ids in samples:
        assert model.ours.decode(ids) == model.sp.decode(ids), [model.sp.id_to_piece(i) for i in ids]


def test_decode_round_trips_where_the_normalizer_allows(model: Trained) -> None:
    """decode(encode(text)) is the text wherever sentencepiece's own round trip gives it back: with the identity
    normalizer, no removal of extra whitespace and byte pieces, that is every text but those holding a "▁"."""
    kept = [text for text in PLAIN_TEXTS + AROUND_SYMBOL if model.sp.decode(model.sp.encode(text)) == text]
    for text in kept:
        assert model.ours.decode(model.encode(text)) == text
    if model.settings._replace(model_type="bpe", add_dummy_prefix=True) == LLAMA_2:
        assert kept == [text for text in PLAIN_TEXTS + AROUND_SYMBOL if "\u2581" not in text]


def test_open_llama_like_checkpoint_generates_as_transformers_from_sentencepiece_ids(tmp_path: Path) -> None:
    """A tiny Llama whose tokenizer.model is trained like open_llama's (BPE, nmt_nfkc, extra whitespace removed,
    dummy prefix, byte fallback, digits split), converted: our prompt ids are sentencepiece's, and our greedy
    tokens from them are transformers' greedy tokens from the same ids."""
    src = _train(tmp_path / "hf", OPEN_LLAMA)
    sp = spm.SentencePieceProcessor(model_file=str(src / "tokenizer.model"))
    config = hf_llama_config(sp.get_piece_size())
    config.bos_token_id, config.eos_token_id = sp.bos_id(), sp.eos_id()
    hf_model = random_llama(config)
    hf_model.save_pretrained(src)
    out = tmp_path / "converted"
    convert_hf(src, out, dtype="float32")
    engine = Engine.load(out, device="cpu", dtype="float32")
    tokenizer = engine.tokenizer

    text = "The capital of France is"
    prompt = tokenizer.encode(text)
    assert prompt == [sp.bos_id(), *sp.encode(text)]
    assert sp.id_to_piece(prompt[1]).startswith("\u2581")  # the dummy prefix, which the normalizer must not strip
    ours = our_greedy(engine, prompt, 24)
    assert ours == hf_greedy(hf_model, prompt, 24)
    written = [i for i in ours if not (sp.is_control(i) or sp.is_unknown(i))]
    assert tokenizer.decode(ours, skip_special=True) == sp.decode(written)


@pytest.mark.parametrize("remove_extra_whitespaces", [False, True], ids=["", "rew"])
def test_unigram_nfkc_without_dummy_prefix_after_a_special_token(trained, remove_extra_whitespaces: bool) -> None:
    """A unigram model with the nfkc normalizer and no dummy prefix, text right after a special token: the README's
    rule gives sentencepiece's own segmentation with the token matched as a user-defined symbol, and no "▁" next to
    it. sentencepiece alone spells a control token such as "</s>" out piece by piece (more ids); transformers puts
    "▁" before the input and segments a unigram model with BPE merges (other ids): both differ, by rule."""
    settings = Settings("unigram", "nfkc", remove_extra_whitespaces, add_dummy_prefix=False, byte_fallback=True)
    model = trained(settings)
    symbol = model.sp.piece_to_id(SYMBOL)
    texts = ["Hello world", "The capital of France is", "ｆｕｌｌ ｗｉｄｔｈ ﬁ ①", " leading space", "\u0301accent"]
    for special in ("</s>", "<s>", CONTROL):
        special_id = model.ours.cfg.special_tokens[special]
        for before in ("", "Hi "):
            for text in texts:
                expected = [special_id if i == symbol else i for i in model.sp.encode(f"{before}{SYMBOL}{text}")]
                assert model.encode(f"{before}{special}{text}") == expected, (special, before, text)
    text = "</s>Hello world"
    ours = model.encode(text)
    assert len(model.sp.encode(text)) > len(ours), "sentencepiece matches </s> in text now"
    assert model.theirs.encode(text, add_special_tokens=False) != ours, f"transformers agrees now: {text!r}"
