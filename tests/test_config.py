import dataclasses
import json

import pytest

from gpt_fast.config import (
    CheckpointConfig,
    RopeScaling,
    TokenizerConfig,
    checkpoint_config_from_dict,
    load_checkpoint_config,
    resolve_checkpoint_dir,
)
from gpt_fast.shapes import SHAPES, get_shape

TOKENIZER = TokenizerConfig(
    kind="huggingface", file="tokenizer.json", bos_id=1, add_bos=True, stop_ids=(2, 3), special_tokens={"<s>": 1}
)


def config_dict(**model_overrides):
    config = CheckpointConfig(model=get_shape("tiny"), tokenizer=TOKENIZER, dtype="float32", chat_template="{{ x }}")
    data = json.loads(config.to_json())
    data["model"].update(model_overrides)
    return data


def test_round_trip_through_json(tmp_path):
    rope = RopeScaling(
        kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    scaled = CheckpointConfig(
        model=dataclasses.replace(SHAPES["llama-3-8b"], rope_scaling=rope), tokenizer=TOKENIZER, dtype="bfloat16"
    )
    (tmp_path / "config.json").write_text(scaled.to_json())
    assert load_checkpoint_config(tmp_path) == scaled


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"n_heads": 4}, "unknown field"),
        ({"n_layer": "2"}, "model.n_layer must be an integer"),
        ({"n_local_heads": 3}, "multiple of n_local_heads"),
        ({"dim": 0}, "model.dim must be a positive integer"),
        ({"head_dim": 7}, "even"),
        ({"norm_eps": -1.0}, "norm_eps"),
        ({"tie_embeddings": 1}, "true or false"),
        ({"rope_scaling": {"kind": "yarn", "factor": 2.0}}, "rope_scaling.kind"),
        ({"rope_scaling": {"kind": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ],
)
def test_inconsistent_model_fields(overrides, message):
    with pytest.raises(ValueError, match=message):
        checkpoint_config_from_dict(config_dict(**overrides))


def test_missing_field():
    data = config_dict()
    del data["model"]["vocab_size"]
    with pytest.raises(ValueError, match="missing field.*vocab_size"):
        checkpoint_config_from_dict(data)


def test_not_a_gpt_fast_config():
    with pytest.raises(ValueError, match="gpt-fast convert"):
        checkpoint_config_from_dict({"hidden_size": 64, "model_type": "llama"})


def test_tokenizer_checks():
    with pytest.raises(ValueError, match="pattern"):
        TokenizerConfig(kind="tiktoken", file="tokenizer.model", bos_id=1, add_bos=True, stop_ids=(2,))
    with pytest.raises(ValueError, match="inside the checkpoint folder"):
        TokenizerConfig(kind="huggingface", file="../tokenizer.json", bos_id=1, add_bos=True, stop_ids=(2,))
    with pytest.raises(ValueError, match="bos_id is null"):
        TokenizerConfig(kind="huggingface", file="tokenizer.json", bos_id=None, add_bos=True, stop_ids=(2,))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_checkpoint_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        resolve_checkpoint_dir(tmp_path / "nothing" / "model.pth")


def test_checkpoint_path_may_be_the_weights_file_or_its_folder(tmp_path):
    (tmp_path / "model.pth").write_bytes(b"")
    assert resolve_checkpoint_dir(tmp_path / "model.pth") == tmp_path
    assert resolve_checkpoint_dir(tmp_path) == tmp_path


def test_shape_registry_lists_known_names():
    with pytest.raises(ValueError, match="known shapes: llama-2-7b, llama-3-8b, smollm2-135m, tiny"):
        get_shape("llama-2-7B")
