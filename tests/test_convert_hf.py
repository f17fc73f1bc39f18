"""HF folder -> our checkpoint: parity with transformers, and every way a source folder can be broken."""

import json
import os
import pickle
import signal
import subprocess
import sys

import pytest
import torch
from tiny import hf_greedy, our_greedy, save_hf_llama

from gpt_fast.checkpoint import load_model
from gpt_fast.config import load_checkpoint_config
from gpt_fast.convert.hf import convert_hf

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES = {
    "safetensors-mha": {"kv_heads": 4, "weights": "safetensors"},
    "sharded-gqa": {"kv_heads": 2, "weights": "sharded"},
    "bin-gqa-tied": {"kv_heads": 2, "weights": "bin", "tie": True},
    "safetensors-tied-llama31-rope": {"kv_heads": 1, "tie": True, "rope_scaling": LLAMA3_ROPE},
}


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    src = tmp_path_factory.mktemp("hf") / request.param
    hf_model = save_hf_llama(src, **CASES[request.param])
    out = src.parent / f"{request.param}-converted"
    convert_hf(src, out, dtype="float32")
    config = load_checkpoint_config(out)
    model = load_model(out, config, torch.device("cpu"), torch.float32)
    return hf_model, model, config


@torch.no_grad()
def test_logits_match_transformers(converted):
    hf_model, model, _ = converted
    tokens = torch.randint(0, hf_model.config.vocab_size, (2, 50), generator=torch.Generator().manual_seed(0))
    model.setup_caches(2, 64)
    diff = (model(tokens, torch.arange(50)) - hf_model(tokens).logits).abs().max().item()
    assert diff < 1e-4


@torch.no_grad()
def test_greedy_tokens_match_transformers(converted):
    hf_model, model, _ = converted
    prompt = [0, 45, 67, 120, 7, 99]
    assert our_greedy(model, prompt, 40) == hf_greedy(hf_model, prompt, 40)


def test_config_records_the_source(converted):
    hf_model, _, config = converted
    assert config.model.tie_embeddings == hf_model.config.tie_word_embeddings
    assert config.model.n_local_heads == hf_model.config.num_key_value_heads
    assert config.source["architecture"] == "LlamaForCausalLM"
    assert config.tokenizer.kind == "huggingface"


def test_default_dtype_keeps_the_source_precision(tmp_path):
    from transformers import LlamaForCausalLM

    src = tmp_path / "hf"
    save_hf_llama(src)
    LlamaForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(src)
    convert_hf(src, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    state = torch.load(tmp_path / "out" / "model.pth", weights_only=True)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


@pytest.fixture
def hf_dir(tmp_path):
    src = tmp_path / "hf"
    save_hf_llama(src, weights="sharded")
    return src


def convert_fails(src, out, match, error=ValueError):
    with pytest.raises(error, match=match):
        convert_hf(src, out)
    assert not out.exists() or not (out / "model.pth").exists()


def shard(src, n=2):
    return src / f"model-0000{n}-of-00007.safetensors"


def test_truncated_shard(hf_dir, tmp_path):
    data = shard(hf_dir).read_bytes()
    shard(hf_dir).write_bytes(data[:-100])
    convert_fails(hf_dir, tmp_path / "out", r"model-00002-of-00007.safetensors: truncated")


def test_extra_bytes_after_the_payload(hf_dir, tmp_path):
    with shard(hf_dir).open("ab") as f:
        f.write(b"trailing garbage")
    convert_fails(hf_dir, tmp_path / "out", r"model-00002-of-00007.safetensors: 16 extra bytes")


def test_missing_shards_are_all_listed_before_loading(hf_dir, tmp_path):
    shard(hf_dir, 3).unlink()
    shard(hf_dir, 5).unlink()
    convert_fails(
        hf_dir,
        tmp_path / "out",
        "missing: model-00003-of-00007.safetensors, model-00005-of-00007.safetensors",
        FileNotFoundError,
    )


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "hf"
    save_hf_llama(src)
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(state, src / "model.safetensors")
    convert_fails(
        src,
        tmp_path / "out",
        r"missing tensor\(s\): model.layers.1.mlp.up_proj.weight; unexpected tensor\(s\): "
        r"model.layers.0.self_attn.q_norm.weight",
    )


def test_shape_disagreeing_with_config(tmp_path):
    src = tmp_path / "hf"
    save_hf_llama(src)
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] = 128
    (src / "config.json").write_text(json.dumps(config))
    convert_fails(
        src,
        tmp_path / "out",
        r"tensor model.layers.0.mlp.gate_proj.weight has shape \[96, 64\], config.json expects \[128, 64\]",
    )


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.pop("hidden_size"), "missing field hidden_size"),
        (lambda c: c.update(num_hidden_layers="two"), "num_hidden_layers has the wrong type"),
        (lambda c: c.update(num_key_value_heads=3), "multiple of n_local_heads"),
        (lambda c: c.update(architectures=["GPT2LMHeadModel"]), "unsupported architecture GPT2LMHeadModel"),
        (
            lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
            "unsupported rope scaling type 'yarn'",
        ),
    ],
)
def test_bad_config_json(tmp_path, edit, match):
    src = tmp_path / "hf"
    save_hf_llama(src)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    convert_fails(src, tmp_path / "out", match)


def test_malformed_config_json(tmp_path):
    src = tmp_path / "hf"
    save_hf_llama(src)
    (src / "config.json").write_text('{"hidden_size": 64,')
    convert_fails(src, tmp_path / "out", "config.json is not valid JSON")


def test_missing_tokenizer(tmp_path):
    src = tmp_path / "hf"
    save_hf_llama(src)
    (src / "tokenizer.json").unlink()
    convert_fails(src, tmp_path / "out", "tokenizer", FileNotFoundError)


class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_unsafe_pickle_is_refused_without_running(tmp_path):
    src = tmp_path / "hf"
    save_hf_llama(src, weights="bin")
    marker = tmp_path / "payload-ran"
    payload = RunsCode()
    payload.marker = marker
    with (src / "pytorch_model.bin").open("wb") as f:
        pickle.dump({"model.embed_tokens.weight": payload}, f)
    convert_fails(src, tmp_path / "out", "unsafe pickle")
    assert not marker.exists()


def test_unwritable_output_folder(hf_dir, tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: False if str(path) == str(locked) else real_access(path, mode)
    )  # root may write anywhere
    convert_fails(hf_dir, locked / "out", "not writable", PermissionError)


def test_output_folder_under_a_file(hf_dir, tmp_path):
    (tmp_path / "file").write_text("")
    convert_fails(hf_dir, tmp_path / "file" / "out", "is not a folder")


def test_an_error_leaves_an_existing_checkpoint_untouched(hf_dir, tmp_path):
    out = tmp_path / "out"
    convert_hf(hf_dir, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    shard(hf_dir).write_bytes(shard(hf_dir).read_bytes()[:-10])
    with pytest.raises(ValueError):
        convert_hf(hf_dir, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_ctrl_c_during_conversion_leaves_nothing(hf_dir, tmp_path):
    """SIGINT while tensors are being converted: non-zero exit and no output folder."""
    out = tmp_path / "out"
    script = (
        "import signal, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even when started with "
        "SIGINT ignored\n"
        "import gpt_fast.convert.layout as layout\n"
        "original = layout.fuse_tensors\n"
        "def slow(tensors, *a):\n"
        "    def stall():\n"
        "        items = iter(tensors)\n"
        "        yield next(items)\n"
        "        print('converting', flush=True)\n"
        "        time.sleep(60)\n"
        "        yield from items\n"
        "    return original(stall(), *a)\n"
        "layout.fuse_tensors = slow\n"
        "import gpt_fast.convert.hf as hf\n"
        "hf.fuse_tensors = slow\n"
        "from gpt_fast.cli import main\n"
        f"main(['convert', {str(hf_dir)!r}, '--output_dir', {str(out)!r}])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "converting"  # one tensor converted, the next one stalls
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.strip().splitlines()[-1] == "error: interrupted"
    assert not out.exists()


@pytest.mark.parametrize("shape", ["llama-2-7b", "llama-3-8b", "smollm2-135m", "tiny"])
def test_hf_config_dict_is_the_inverse_of_reading_one(shape):
    from gpt_fast.convert.hf_config import hf_config_dict, model_config_from_hf
    from gpt_fast.shapes import get_shape

    assert model_config_from_hf(hf_config_dict(get_shape(shape)), "config.json") == get_shape(shape)


def test_split_tensors_is_the_inverse_of_fusing():
    from gpt_fast.convert.layout import fuse_tensors, split_tensors
    from gpt_fast.convert.random_init import random_weights
    from gpt_fast.shapes import get_shape

    shape = get_shape("tiny")
    state = random_weights(shape, torch.float32, seed=0)
    again = fuse_tensors(split_tensors(state, shape).items(), shape, torch.float32)
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)
