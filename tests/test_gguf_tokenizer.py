"""A GGUF file's tokenizer rebuilt as tokenizer.json, matching transformers' own GGUF loading."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from gpt_fast.convert.gguf_tokenizer import merges_from_scores, tokenizer_from_gguf
from gpt_fast.convert.hf_tokenizer import tokenizer_from_hf_dir
from gpt_fast.text.chat_template import render_chat
from gpt_fast.text.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

SMOLLM2_CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 * 12?\nAnswer with digits only."},
    {"role": "assistant", "content": "144"},
    {"role": "user", "content": "And <|im_end|> in text? Unicode: café 😀\tdone"},
]


def write_gguf(path: Path, model: str, tokens: list[str], types: list[int], **extra) -> Path:
    """A GGUF holding only tokenizer metadata (and the few llama keys transformers reads for its config)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    for key, value in extra.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_parity(path: Path, out: Path, texts: list[str]):
    cfg, template = tokenizer_from_gguf(gguf.GGUFReader(path), out)
    ours = load_tokenizer(out, cfg)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in texts:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, bos=False) == ids, text
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special=True) == theirs.decode(ids, skip_special_tokens=True), text
    assert (cfg.bos_id, cfg.bos_token, cfg.eos_token) == (theirs.bos_token_id, theirs.bos_token, theirs.eos_token)
    assert theirs.eos_token_id in cfg.stop_ids
    invented = {
        text: i for text, i in special_added_tokens(theirs).items() if i >= ours.vocab_size
    }  # see the byte-level test
    assert cfg.special_tokens == {text: i for text, i in special_added_tokens(theirs).items() if text not in invented}
    return ours, cfg, template, theirs


def special_added_tokens(hf_tokenizer) -> dict[str, int]:
    return {token.content: token_id for token_id, token in hf_tokenizer.added_tokens_decoder.items() if token.special}


def sentencepiece_style_gguf(sentencepiece_dir: Path, path: Path) -> Path:
    """The tiny SentencePiece model as a "llama" GGUF vocabulary (its <tool> a user-defined, non-special token)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto.FromString((sentencepiece_dir / "tokenizer.model").read_bytes())
    return write_gguf(
        path,
        "llama",
        [p.piece for p in proto.pieces],
        [p.type for p in proto.pieces],
        token_scores=[p.score for p in proto.pieces],
        bos_token_id=1,
        eos_token_id=2,
        unk_token_id=0,
        chat_template="{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}",
    )


def test_sentencepiece_style_gguf_matches_transformers(
    sentencepiece_dir: Path, tmp_path: Path, varied_texts: list[str]
) -> None:
    path = sentencepiece_style_gguf(sentencepiece_dir, tmp_path / "sp.gguf")
    ours, cfg, template, _ = gguf_parity(path, tmp_path / "out", varied_texts)
    assert (cfg.add_bos, cfg.stop_ids) == (True, (2,))  # a "llama" vocabulary adds BOS unless the file says not
    assert template.startswith("{% for m in messages %}")
    sp = load_tokenizer(sentencepiece_dir, tokenizer_from_hf_dir(sentencepiece_dir, {})[0])
    for text in varied_texts:  # the same ids as the SentencePiece model the vocabulary came from, except where
        if not text.startswith((" ", "\u2581")):  # the GGUF vocabulary follows transformers, not sentencepiece
            assert ours.encode(text) == sp.encode(text), text


def test_literal_text_after_a_control_token_encodes_as_after_any_added_token(
    sentencepiece_dir: Path, tmp_path: Path
) -> None:
    """Its tokenizer.json puts "▁" only before the start of the text (Metaspace, prepend_scheme "first"): literal
    text after the control token </s> encodes as transformers encodes it, special tokens split, after the
    non-special added token <tool>."""
    path = sentencepiece_style_gguf(sentencepiece_dir, tmp_path / "sp.gguf")
    cfg, _ = tokenizer_from_gguf(gguf.GGUFReader(path), tmp_path / "out")
    ours = load_tokenizer(tmp_path / "out", cfg)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for literal in ["x</s>y", "hello <s> world", "</s>", " <unk>\n<tool>z"]:
        after_tool = theirs.encode("<tool>" + literal, add_special_tokens=False, split_special_tokens=True)
        assert after_tool[0] == theirs.convert_tokens_to_ids("<tool>") == 4
        text = "</s>" + literal
        assert ours.encode(text, bos=False, literal_spans=[(4, len(text))]) == [2, *after_tool[1:]], literal
        assert ours.encode(literal, bos=False, literal_spans=[(0, len(literal))]) == theirs.encode(
            literal, add_special_tokens=False, split_special_tokens=True
        )


def test_byte_level_gguf_matches_transformers(
    byte_level_bpe_dir: Path, tmp_path: Path, varied_texts: list[str]
) -> None:
    data = json.loads((byte_level_bpe_dir / "tokenizer.json").read_text())
    vocab = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [3 if token.startswith("<|") else 1 for token in tokens]
    path = write_gguf(
        tmp_path / "bpe.gguf",
        "gpt2",
        tokens,
        types,
        token_merges=merges,
        tokenizer_pre="llama-bpe",
        bos_token_id=555,
        eos_token_id=556,
        eot_token_id=559,
        add_bos_token=True,
    )
    # transformers builds this vocabulary with GPT2Tokenizer, whose default BOS/EOS/UNK "<|endoftext|>" it then
    # appends as a new token (id 560, past the model's vocabulary) when the file lacks it; we keep it plain text.
    texts = [text for text in varied_texts if "<|endoftext|>" not in text]
    ours, cfg, template, theirs = gguf_parity(path, tmp_path / "out", texts)
    assert theirs.convert_tokens_to_ids("<|endoftext|>") == len(tokens) == ours.vocab_size
    assert (cfg.add_bos, cfg.stop_ids, template) == (True, (556, 559), None)
    reference = load_tokenizer(byte_level_bpe_dir, tokenizer_from_hf_dir(byte_level_bpe_dir, {})[0])
    for text in varied_texts:  # the same ids as the tokenizer.json the vocabulary came from
        assert ours.encode(text) == reference.encode(text), text


def test_unsupported_gguf_tokenizer_is_named(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bert.gguf", "bert", ["[PAD]", "a"], [3, 1])
    with pytest.raises(ValueError, match="'bert'"):
        tokenizer_from_gguf(gguf.GGUFReader(path), tmp_path / "out")
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_gguf_vocabulary_that_cannot_encode_text_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", "llama", ["<unk>", "<s>", "</s>"], [2, 3, 3], token_scores=[0.0] * 3)
    with pytest.raises(ValueError, match=r"GGUF file's tokenizer .*: its BPE model gives no tokens for plain text"):
        tokenizer_from_gguf(gguf.GGUFReader(path), tmp_path / "out")


def test_merges_from_scores_rank_by_score_then_length() -> None:
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    assert merges_from_scores(tokens, [0, 0, 0, -1.0, -2.0, -0.5]) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers(
    smollm2_gguf: Path, smollm2_tokenizer, smollm2_hf_tokenizer, varied_texts: list[str]
) -> None:
    ours, cfg, template = smollm2_tokenizer
    theirs = smollm2_hf_tokenizer
    rendered = render_chat(template, SMOLLM2_CONVERSATION, bos_token=cfg.bos_token, eos_token=cfg.eos_token)
    for text in [*varied_texts, rendered]:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, bos=False) == ids, text
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids) == text, text
        assert ours.decode(ids, skip_special=True) == theirs.decode(ids, skip_special_tokens=True), text
    assert theirs.apply_chat_template(
        SMOLLM2_CONVERSATION, add_generation_prompt=True, return_dict=False
    ) == ours.encode(rendered, bos=False)
    assert (
        (cfg.bos_id, cfg.bos_token, cfg.eos_token, cfg.add_bos)
        == (theirs.bos_token_id, theirs.bos_token, theirs.eos_token, False)
        == (1, "<|im_start|>", "<|im_end|>", False)
    )
    assert cfg.stop_ids == (2,) and ours.stop_ids == (2,)
    assert cfg.special_tokens == special_added_tokens(theirs) and len(cfg.special_tokens) == 17
    assert template == theirs.chat_template
    assert ours.vocab_size == len(theirs) == 49152
