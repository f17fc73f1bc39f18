import dataclasses
import json
import math
import os
import re

import pytest

from gpt_fast.model.config import (
    CheckpointConfig,
    EmbeddingQuant,
    QuantConfig,
    RopeScaling,
    TokenizerConfig,
    checkpoint_config_from_dict,
    load_checkpoint_config,
    resolve_checkpoint_dir,
)
from gpt_fast.model.shapes import SHAPES, get_shape

TOKENIZER = TokenizerConfig(
    kind="huggingface", file="tokenizer.json", bos_id=1, add_bos=True, stop_ids=(2, 3), special_tokens={"<s>": 1}
)


def config_dict(**model_overrides):
    config = CheckpointConfig(model=get_shape("tiny"), tokenizer=TOKENIZER, dtype="float32", chat_template="{{ x }}")
    data = json.loads(config.to_json())
    data["model"].update(model_overrides)
    return data


def test_quantization_round_trips_and_defaults_to_none(tmp_path):
    quantized = CheckpointConfig(
        model=get_shape("tiny"), tokenizer=TOKENIZER, dtype="bfloat16", quantization=QuantConfig("int4", 64, True)
    )
    (tmp_path / "config.json").write_text(quantized.to_json())
    assert load_checkpoint_config(tmp_path) == quantized
    assert load_checkpoint_config(tmp_path).quantization.name == "int4-g64"
    older = config_dict()
    del older["quantization"]  # written before quantization existed
    assert checkpoint_config_from_dict(older).quantization is None
    table = QuantConfig("int4", 32, embeddings=EmbeddingQuant("int8", 32))
    tied = dataclasses.replace(quantized, model=dataclasses.replace(get_shape("tiny"), tie_embeddings=True))
    (tmp_path / "config.json").write_text(dataclasses.replace(tied, quantization=table).to_json())
    assert load_checkpoint_config(tmp_path).quantization == table
    assert table.name == "int4-g32, embeddings int8-g32"


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
    with pytest.raises(ValueError, match=re.escape(f"known shapes: {', '.join(SHAPES)}")):
        get_shape("llama-2-7B")
    assert {"qwen2.5-7b", "gemma-2-9b", "mixtral-8x7b", "tiny"} <= set(SHAPES)


def nested(depth):
    return "[" * depth + "]" * depth


# config.json edits (a function of the JSON object, or the file's text) -> what the one-line error must say
BAD_CONFIGS = {
    "model is a list": (lambda c: c.update(model=[]), r"config.json.model must be a JSON object, got list"),
    "bool as a string": (lambda c: c["model"].update(tie_embeddings="false"), r"tie_embeddings must be true or false"),
    "null size": (lambda c: c["model"].update(n_layer=None), r"model.n_layer must be an integer, got None"),
    "size as a string": (lambda c: c["model"].update(dim="64"), r"model.dim must be an integer"),
    "zero heads": (lambda c: c["model"].update(n_head=0), r"model.n_head must be a positive integer"),
    "negative size": (lambda c: c["model"].update(vocab_size=-5), r"model.vocab_size must be a positive integer"),
    "absurd layers": (
        lambda c: c["model"].update(n_layer=10**8),
        r"model.n_layer must be a positive integer \(at most",
    ),
    "absurd width": (lambda c: c["model"].update(dim=10**30), r"model.dim must be a positive integer \(at most"),
    "infinite rope base": (lambda c: c["model"].update(rope_base=math.inf), r"model.rope_base must be a finite number"),
    "nan norm eps": (lambda c: c["model"].update(norm_eps=math.nan), r"model.norm_eps must be a finite number"),
    "infinite rope factor": (
        lambda c: c["model"].update(rope_scaling={"kind": "linear", "factor": math.inf}),
        r"rope_scaling.factor must be a finite number",
    ),
    "zero low_freq_factor": (
        lambda c: c["model"].update(rope_scaling={**LLAMA3, "low_freq_factor": 0}),
        r"rope_scaling.low_freq_factor must be a finite number > 0, got 0",
    ),
    "zero old context": (
        lambda c: c["model"].update(rope_scaling={**LLAMA3, "original_max_position_embeddings": 0}),
        r"rope_scaling.original_max_position_embeddings must be a positive integer",
    ),
    "zero divisor": (
        lambda c: c["model"].update(rope_scaling={"kind": "divisors", "divisors": [1.0] * 7 + [0.0]}),
        r"rope_scaling.divisors\[7\] must be a finite number > 0",
    ),
    "bos outside the vocabulary": (
        lambda c: c["tokenizer"].update(bos_id=512),
        r"tokenizer.bos_id = 512 is outside the model's vocabulary \(model.vocab_size = 512\)",
    ),
    "negative stop id": (lambda c: c["tokenizer"].update(stop_ids=[2, -1]), r"tokenizer.stop_ids\[1\] = -1 is outside"),
    "special token outside": (
        lambda c: c["tokenizer"]["special_tokens"].update({"<x>": 10**6}),
        r"tokenizer.special_tokens\['<x>'\] = 1000000 is outside",
    ),
    "stop ids an object": (lambda c: c["tokenizer"].update(stop_ids={"a": 1}), r"tokenizer.stop_ids must be a list"),
    "integer dtype": (lambda c: c.update(dtype="int8"), r"dtype 'int8' is not one of float32, bfloat16, float16"),
    "weights outside the folder": (
        lambda c: c.update(weights="../other/model.pth"),
        r"weights must be a path inside the checkpoint folder, got '../other/model.pth'",
    ),
    "weights absolute": (lambda c: c.update(weights="/etc/passwd"), r"weights must be a path inside the checkpoint"),
    "weights empty": (lambda c: c.update(weights=""), r"weights must be a path inside the checkpoint"),
    "quantization mode": (lambda c: c.update(quantization={"mode": "int3"}), r"quantization.mode 'int3' is not one"),
    "int4 group of 7": (
        lambda c: c.update(quantization={"mode": "int4", "group_size": 7}),
        r"quantization.group_size must be one of 32, 64, 128, 256 for int4, got 7",
    ),
    "int4 without a group": (
        lambda c: c.update(quantization={"mode": "int4"}),
        r"quantization.group_size must be one of 32, 64, 128, 256 for int4, got None",
    ),
    "int8 with a group": (
        lambda c: c.update(quantization={"mode": "int8", "group_size": 32}),
        r"quantization.group_size goes with int4 only, got 32",
    ),
    "group as a string": (
        lambda c: c.update(quantization={"mode": "int4", "group_size": "32"}),
        r"quantization.group_size must be an integer",
    ),
    "output as a number": (
        lambda c: c.update(quantization={"mode": "int8", "output": 1}),
        r"quantization.output must be true or false, got 1",
    ),
    "unknown quantization field": (
        lambda c: c.update(quantization={"mode": "int8", "bits": 8}),
        r"config.json.quantization: unknown field\(s\) bits",
    ),
    "unknown quantization method": (
        lambda c: c.update(quantization={"mode": "int4", "group_size": 32, "method": "awq"}),
        r"quantization.method 'awq' is not one of rtn, gptq",
    ),
    "gptq with int8": (
        lambda c: c.update(quantization={"mode": "int8", "method": "gptq"}),
        r"quantization.method gptq goes with int4 only",
    ),
    "keep_float not a projection": (
        lambda c: c.update(quantization={"mode": "int8", "keep_float": ["tok_embeddings"]}),
        r"quantization.keep_float: 'tok_embeddings' is not a layer's projection",
    ),
    "keep_float as a string": (
        lambda c: c.update(quantization={"mode": "int8", "keep_float": "layers.0.attention.wo"}),
        r"quantization.keep_float must be a list",
    ),
    "keep_float twice": (
        lambda c: c.update(quantization={"mode": "int8", "keep_float": ["layers.0.attention.wo"] * 2}),
        r"quantization.keep_float names a layer twice",
    ),
    "keep_float beyond the layers": (
        lambda c: c.update(quantization={"mode": "int8", "keep_float": ["layers.99.feed_forward.w2"]}),
        r"quantization.keep_float: 'layers.99.feed_forward.w2' is beyond the model's layers \(model.n_layer = 2\)",
    ),
    "table in int4": (
        lambda c: c.update(quantization={"mode": "int4", "group_size": 32, "embeddings": {"mode": "int4"}}),
        r"quantization.embeddings.mode 'int4' is not one of int8",
    ),
    "table group of 7": (
        lambda c: c.update(quantization={"mode": "int8", "embeddings": {"group_size": 7}}),
        r"quantization.embeddings.group_size must be null or one of 32, 64, 128, 256, got 7",
    ),
    "table quantized twice": (
        lambda c: c.update(quantization={"mode": "int8", "output": True, "embeddings": {"group_size": 32}}),
        r"quantization.output and quantization.embeddings exclude each other",
    ),
    "table of an untied model": (
        lambda c: c.update(quantization={"mode": "int8", "embeddings": {"group_size": 32}}),
        r"quantization.embeddings quantizes a tied embedding table, and model.tie_embeddings is false",
    ),
    "int4 of an odd width": (
        lambda c: c.update(quantization={"mode": "int4", "group_size": 32}) or c["model"].update(dim=63),
        r"int4 quantization packs two input columns per byte: model.dim \(63\) is odd",
    ),
    "a list, not an object": ("[1, 2]", r"must hold a JSON object, not a list"),
    "nested too deeply": ('{"source": ' + nested(100_000) + "}", r"not valid JSON: nested too deeply"),
    "an integer of 5000 digits": ('{"x": ' + "9" * 5000 + "}", r"not valid JSON: .*digits"),
    "not UTF-8": (b'{"x": "\xff"}', r"not valid JSON"),
}
LLAMA3 = {
    "kind": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_is_one_line_naming_file_and_field(name, tmp_path):
    edit, message = BAD_CONFIGS[name]
    path = tmp_path / "config.json"
    if isinstance(edit, bytes):
        path.write_bytes(edit)
    elif isinstance(edit, str):
        path.write_text(edit)
    else:
        data = config_dict()
        edit(data)
        path.write_text(json.dumps(data))  # json writes NaN and Infinity, as Python's reader accepts them
    with pytest.raises(ValueError) as info:
        load_checkpoint_config(tmp_path)
    assert str(path) in str(info.value) and len(str(info.value).splitlines()) == 1
    assert re.search(message, str(info.value)), info.value


def test_a_pipe_is_refused_without_opening_it(tmp_path):
    """Opening a FIFO for reading would block until a writer comes; it is refused from its ``stat``."""
    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"config.json is not a regular file"):
        load_checkpoint_config(tmp_path)
    os.mkfifo(tmp_path / "model.pth")
    with pytest.raises(ValueError, match=r"checkpoint .*model.pth is not a regular file"):
        resolve_checkpoint_dir(tmp_path / "model.pth")


def test_the_tokenizer_ids_are_checked_against_the_model():
    tokenizer = dataclasses.replace(TOKENIZER, stop_ids=(2, 512))
    with pytest.raises(ValueError, match=r"tokenizer.stop_ids\[1\] = 512 is outside the model's vocabulary"):
        CheckpointConfig(model=get_shape("tiny"), tokenizer=tokenizer, dtype="float32")
