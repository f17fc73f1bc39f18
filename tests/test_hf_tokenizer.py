"""Choosing a Hugging Face folder's tokenizer and its special tokens, matching transformers."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from gpt_fast.convert.hf_tokenizer import tokenizer_from_hf_dir
from gpt_fast.convert.tokenizer_common import LLAMA3_PATTERN, with_template_stop_id
from gpt_fast.text.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def test_sentencepiece_file_is_recognised_by_content(sentencepiece_dir: Path, tmp_path: Path) -> None:
    src = copy_dir(sentencepiece_dir, tmp_path / "ckpt")
    (src / "tokenizer_config.json").unlink()  # ids then come from the model file itself
    cfg, files, template = tokenizer_from_hf_dir(src, {})
    assert cfg.kind == "sentencepiece" and cfg.file == "tokenizer.model" and files == [src / "tokenizer.model"]
    assert (cfg.bos_id, cfg.add_bos, cfg.stop_ids, cfg.bos_token, cfg.eos_token) == (1, True, (2,), "<s>", "</s>")
    assert cfg.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2, "<ctl>": 3, "<tool>": 4}
    assert template is None


def test_tiktoken_file_in_original_is_recognised_by_content(tiktoken_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    (src / "original").mkdir(parents=True)
    shutil.copy(tiktoken_dir / "tokenizer.model", src / "original" / "tokenizer.model")
    shutil.copy(tiktoken_dir / "tokenizer_config.json", src / "tokenizer_config.json")
    write_json(src / "generation_config.json", {"bos_token_id": 555, "eos_token_id": [556, 559]})
    cfg, files, _ = tokenizer_from_hf_dir(src, {"bos_token_id": 555, "eos_token_id": 556})
    assert cfg.kind == "tiktoken" and cfg.file == "tokenizer.model" and files == [src / "original" / "tokenizer.model"]
    assert cfg.pattern == LLAMA3_PATTERN
    assert (cfg.bos_id, cfg.add_bos, cfg.stop_ids, cfg.bos_token, cfg.eos_token) == (
        555,
        True,
        (556, 559),
        "<|begin_of_text|>",
        "<|eot_id|>",
    )
    assert cfg.special_tokens["<|start_header_id|>"] == 557
    assert load_tokenizer(src / "original", cfg).encode("hi<|eot_id|>")[::2] == [555, 559]


def test_tiktoken_file_without_added_tokens_is_an_error(tiktoken_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "ckpt"
    src.mkdir()
    shutil.copy(tiktoken_dir / "tokenizer.model", src / "tokenizer.model")
    with pytest.raises(ValueError, match="added_tokens_decoder"):
        tokenizer_from_hf_dir(src, {})


def test_tokenizer_json_is_preferred_and_post_processor_decides_bos(
    byte_level_bpe_dir: Path, sentencepiece_dir: Path, tmp_path: Path
) -> None:
    src = copy_dir(byte_level_bpe_dir, tmp_path / "ckpt")
    shutil.copy(sentencepiece_dir / "tokenizer.model", src / "tokenizer.model")
    write_json(src / "generation_config.json", {"eos_token_id": [556, 559]})
    cfg, files, _ = tokenizer_from_hf_dir(src, {"eos_token_id": 556})
    assert cfg.kind == "huggingface" and files == [src / "tokenizer.json"]
    assert (cfg.bos_id, cfg.add_bos, cfg.stop_ids) == (555, True, (556, 559))
    theirs = transformers.AutoTokenizer.from_pretrained(str(src))
    assert load_tokenizer(src, cfg).encode("hello <|eot_id|>") == theirs.encode("hello <|eot_id|>")


def test_add_bos_token_in_tokenizer_config_overrides_the_post_processor(
    byte_level_bpe_dir: Path, tmp_path: Path
) -> None:
    src = copy_dir(byte_level_bpe_dir, tmp_path / "ckpt")
    config = json.loads((src / "tokenizer_config.json").read_text())
    write_json(src / "tokenizer_config.json", {**config, "add_bos_token": False})
    cfg, _, _ = tokenizer_from_hf_dir(src, {})
    assert cfg.add_bos is False and cfg.bos_id == 555


def test_bos_without_metadata_comes_from_the_post_processor(byte_level_bpe_dir: Path, tmp_path: Path) -> None:
    src = copy_dir(byte_level_bpe_dir, tmp_path / "ckpt")
    (src / "tokenizer_config.json").unlink()
    cfg, _, _ = tokenizer_from_hf_dir(src, {"eos_token_id": 559})
    assert (cfg.bos_id, cfg.bos_token, cfg.add_bos, cfg.stop_ids, cfg.eos_token) == (
        555,
        "<|begin_of_text|>",
        True,
        (559,),
        "<|eot_id|>",
    )


LLAMA3_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
)


def test_end_of_turn_token_of_the_chat_template_is_a_stop_id(byte_level_bpe_dir: Path, tmp_path: Path) -> None:
    src = copy_dir(byte_level_bpe_dir, tmp_path / "ckpt")
    write_json(src / "tokenizer_config.json", {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    (src / "chat_template.jinja").write_text(LLAMA3_LIKE_TEMPLATE)
    cfg, _, template = tokenizer_from_hf_dir(src, {"eos_token_id": 556})
    assert template == LLAMA3_LIKE_TEMPLATE
    assert cfg.stop_ids == (556, 559)  # config.json's EOS, then <|eot_id|>, which ends each templated turn


@pytest.mark.parametrize(
    "template",
    [
        "{{ raise_exception('no assistant turns here') }}",
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
        "{{ messages[5]['content'] }}",
    ],
    ids=["raises", "no-end-token", "undefined"],
)
def test_templates_without_an_end_of_turn_token_leave_stop_ids(byte_level_bpe_dir: Path, template: str) -> None:
    cfg = dataclasses.replace(tokenizer_from_hf_dir(byte_level_bpe_dir, {})[0], stop_ids=(556,))
    assert with_template_stop_id(cfg, template, "t.jinja") == cfg
    assert with_template_stop_id(cfg, LLAMA3_LIKE_TEMPLATE, "t.jinja").stop_ids == (556, 559)


def test_missing_tokenizer_lists_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json.*tokenizer\.model.*original/tokenizer\.model"):
        tokenizer_from_hf_dir(tmp_path, {})


def test_unreadable_tokenizer_model_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"\x08\x96\x01garbage\xff\x00")
    with pytest.raises(ValueError, match="tokenizer.model"):
        tokenizer_from_hf_dir(tmp_path, {})


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"tokenizer_config.json": {"chat_template": "plain"}}, "plain"),
        (
            {
                "tokenizer_config.json": {
                    "chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
                }
            },
            "d",
        ),
        ({"tokenizer_config.json": {"chat_template": "old"}, "chat_template.jinja": "from file"}, "from file"),
        ({"tokenizer_config.json": {}}, None),
    ],
    ids=["string", "named-list", "jinja-file", "none"],
)
def test_chat_template_sources(sentencepiece_dir: Path, tmp_path: Path, files: dict, expected: str | None) -> None:
    src = tmp_path / "ckpt"
    src.mkdir()
    shutil.copy(sentencepiece_dir / "tokenizer.model", src / "tokenizer.model")
    for name, content in files.items():
        (src / name).write_text(content if isinstance(content, str) else json.dumps(content))
    assert tokenizer_from_hf_dir(src, {})[2] == expected


def test_tiktoken_file_with_duplicate_ranks_is_named_not_taken_for_sentencepiece(
    tiktoken_dir: Path, tmp_path: Path
) -> None:
    src = copy_dir(tiktoken_dir, tmp_path / "ckpt")
    lines = (src / "tokenizer.model").read_text().splitlines()
    (src / "tokenizer.model").write_text("\n".join([*lines, f"{lines[300].split()[0]} 9"]) + "\n")
    with pytest.raises(ValueError, match=rf"tokenizer\.model line {len(lines) + 1}: token \S+ is listed twice"):
        tokenizer_from_hf_dir(src, {})


def test_tokenizer_json_whose_model_cannot_encode_text_is_an_error(tmp_path: Path) -> None:
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="tokenizer.json: its WordPiece model gives only its unknown token"):
        tokenizer_from_hf_dir(tmp_path, {})
