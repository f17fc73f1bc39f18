"""HF folder -> our checkpoint: parity with transformers, and every way a source folder can be broken."""

import json
import math
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import hf_greedy, our_greedy, save_hf_llama, torch_archive

from gpt_fast.convert.hf import convert_hf
from gpt_fast.engine.engine import Engine
from gpt_fast.model.config import load_checkpoint_config

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
    engine = Engine.load(out, device="cpu", dtype="float32")
    return hf_model, engine.model, engine


@torch.no_grad()
def test_logits_match_transformers(converted):
    hf_model, model, _ = converted
    tokens = torch.randint(0, hf_model.config.vocab_size, (2, 50), generator=torch.Generator().manual_seed(0))
    model.setup_caches(2, 64)
    diff = (model(tokens, torch.arange(50)) - hf_model(tokens).logits).abs().max().item()
    assert diff < 1e-4


@torch.no_grad()
def test_greedy_tokens_match_transformers(converted):
    hf_model, _, engine = converted
    prompt = [0, 45, 67, 120, 7, 99]
    assert our_greedy(engine, prompt, 40) == hf_greedy(hf_model, prompt, 40)


def test_config_records_the_source(converted):
    hf_model, _, engine = converted
    config = engine.config
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
    torch_archive(src / "pytorch_model.bin", pickle.dumps({"model.embed_tokens.weight": payload}))
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
        "from gpt_fast.cli.main import main\n"
        f"main(['convert', {str(hf_dir)!r}, '--output_dir', {str(out)!r}])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "converting"  # one tensor converted, the next one stalls
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.strip().splitlines()[-1] == "error: interrupted"
    assert not out.exists()


def tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(argv, capsys):
    from gpt_fast.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_converting_again_in_the_blog_layout_keeps_the_source(tmp_path, monkeypatch, capsys):
    """`convert checkpoints/ORG/NAME/hf` writes checkpoints/ORG/NAME, the folder its source lies in: a second
    conversion replaces the checkpoint as a whole and hf/ stays as it was."""
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "checkpoints" / "org" / "name" / "hf"
    save_hf_llama(src, weights="sharded")
    source_files = tree(src)
    for dtype in ("float32", "bfloat16"):
        code, out, err = run_cli(["convert", "checkpoints/org/name/hf", "--dtype", dtype], capsys)
        assert code == 0, err
    out_dir = src.parent
    assert sorted(p.name for p in out_dir.iterdir()) == ["config.json", "hf", "model.pth", "tokenizer.json"]
    assert load_checkpoint_config(out_dir).dtype == "bfloat16" and tree(src) == source_files
    assert [p.name for p in out_dir.parent.iterdir()] == ["name"]


def test_converting_into_a_hugging_face_folder_is_one_error_line(hf_dir, tmp_path, capsys):
    other = tmp_path / "other"
    save_hf_llama(other)
    before = tree(other)
    capsys.readouterr()  # transformers' progress bars
    code, _, err = run_cli(["convert", str(hf_dir), "--output_dir", str(other)], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: refusing to write into {other}: its config.json is not a gpt-fast checkpoint's")
    assert tree(other) == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf", "other"]


@pytest.mark.parametrize("shape", ["llama-2-7b", "llama-3-8b", "smollm2-135m", "tiny"])
def test_hf_config_dict_is_the_inverse_of_reading_one(shape):
    from gpt_fast.convert.hf_config import hf_config_dict, model_config_from_hf
    from gpt_fast.model.shapes import get_shape

    assert model_config_from_hf(hf_config_dict(get_shape(shape)), "config.json") == get_shape(shape)


def test_split_tensors_is_the_inverse_of_fusing():
    from gpt_fast.convert.layout import fuse_tensors, split_tensors
    from gpt_fast.convert.random_init import random_weights
    from gpt_fast.model.shapes import get_shape

    shape = get_shape("tiny")
    state = random_weights(shape, torch.float32, seed=0)
    again = fuse_tensors(split_tensors(state, shape).items(), shape, torch.float32, Path("state"))
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)


@pytest.fixture(scope="module")
def pristine_sharded(tmp_path_factory):
    src = tmp_path_factory.mktemp("pristine") / "hf"
    save_hf_llama(src, weights="sharded")
    return src


def edit_json(name, edit):
    def apply(src):
        data = json.loads((src / name).read_text())
        edit(data)
        (src / name).write_text(json.dumps(data))  # NaN and Infinity as Python's json writes (and reads) them

    return apply


def edit_header(shard_number, edit):
    """Rewrite a shard's safetensors header (a dict) with ``edit``, keeping its data."""

    def apply(src):
        path = shard(src, shard_number)
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        header = edit(header) or header
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])

    return apply


def as_bin(edit):
    """Replace the shards by one pytorch_model.bin holding the same tensors after ``edit(state)``."""

    def apply(src):
        from safetensors.torch import load_file

        state = {}
        for path in sorted(src.glob("*.safetensors")):
            state.update(load_file(path))
            path.unlink()
        (src / "model.safetensors.index.json").unlink()
        edit(state)
        torch.save(state, src / "pytorch_model.bin")

    return apply


def link_shard_out(src):
    outside = src.parent / "outside.safetensors"
    shard(src).rename(outside)
    shard(src).symlink_to(outside)


def loop_shard(src):
    shard(src).unlink()
    shard(src).symlink_to(shard(src).name)


def set_nan(state):
    state["model.norm.weight"][3] = float("nan")


def first_entry(header):
    return header[next(k for k in header if k != "__metadata__")]


# Edits of a sharded HF folder -> what the one-line error says (each is caught before any tensor is converted,
# except NaN weights, which need the data)
BAD_HF_SOURCES = {
    "bool as a string": (
        edit_json("config.json", lambda c: c.update(tie_word_embeddings="false")),
        r"config.json: field tie_word_embeddings has the wrong type \('false'; it must be true or false\)",
    ),
    "zero heads": (
        edit_json("config.json", lambda c: c.update(num_attention_heads=0)),
        r"field num_attention_heads has the wrong type \(0; it must be a positive integer\)",
    ),
    "null size": (edit_json("config.json", lambda c: c.update(vocab_size=None)), r"missing field vocab_size"),
    "architectures a string": (
        edit_json("config.json", lambda c: c.update(architectures="LlamaForCausalLM")),
        r"field architectures has the wrong type",
    ),
    "sliding_window a bool": (
        edit_json("config.json", lambda c: c.update(sliding_window=True)),
        r"field sliding_window has the wrong type",
    ),
    "ten million layers": (
        edit_json("config.json", lambda c: c.update(num_hidden_layers=10**7)),
        r"hf holds 21 tensors, a model of 10000000 layers \(n_layer\) has 90000003",
    ),
    "absurd width": (
        edit_json("config.json", lambda c: c.update(hidden_size=10**30)),
        r"model.dim must be a positive integer \(at most 16777216\)",
    ),
    "infinite rope factor": (
        edit_json("config.json", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": math.inf})),
        r"rope_scaling: field factor has the wrong type \(inf; it must be a finite number\)",
    ),
    "zero low_freq_factor": (
        edit_json("config.json", lambda c: c.update(rope_scaling={**LLAMA3_ROPE, "low_freq_factor": 0})),
        r"rope_scaling.low_freq_factor must be a finite number > 0, got 0",
    ),
    "rope_scaling a list": (
        edit_json("config.json", lambda c: c.update(rope_scaling=[1])),
        r"field rope_scaling has the wrong type",
    ),
    "config a list": (lambda src: (src / "config.json").write_text("[]"), r"config.json must hold a JSON object"),
    "config nested too deeply": (
        lambda src: (src / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        r"config.json is not valid JSON: nested too deeply",
    ),
    "vocabulary larger than the embedding": (
        edit_json("config.json", lambda c: c.update(vocab_size=c["vocab_size"] - 1)),
        r"tokenizer.json: the tokenizer has 320 tokens, more than the model's embedding table "
        r"\(model.vocab_size = 319\)",
    ),
    "added_tokens_decoder a list": (
        edit_json("tokenizer_config.json", lambda t: t.update(added_tokens_decoder=[{"content": "<s>"}])),
        r"tokenizer_config.json: added_tokens_decoder must be an object of token id -> token",
    ),
    "added token of null content": (
        edit_json("tokenizer_config.json", lambda t: t.update(added_tokens_decoder={"0": {"content": None}})),
        r"tokenizer_config.json: added_tokens_decoder\['0'\] must be an object with a string content",
    ),
    "added token of numeric content": (
        edit_json("tokenizer_config.json", lambda t: t.update(added_tokens_decoder={"0": {"content": 7}})),
        r"added_tokens_decoder\['0'\] must be an object with a string content, got \{'content': 7\}",
    ),
    "added token id not a number": (
        edit_json("tokenizer_config.json", lambda t: t.update(added_tokens_decoder={"x": {"content": "<s>"}})),
        r"added_tokens_decoder\['x'\]: the key must be a token id",
    ),
    "bos_token a number": (
        edit_json("tokenizer_config.json", lambda t: t.update(bos_token=0)),
        r"tokenizer_config.json: bos_token must be a string or an object with a string content, got 0",
    ),
    "eos_token a list": (
        edit_json("tokenizer_config.json", lambda t: t.update(eos_token=["</s>"])),
        r"tokenizer_config.json: eos_token must be a string or an object with a string content",
    ),
    "eos_token of numeric content": (
        edit_json("tokenizer_config.json", lambda t: t.update(eos_token={"content": 1})),
        r"tokenizer_config.json: eos_token must be a string or an object with a string content",
    ),
    "add_bos_token a string": (
        edit_json("tokenizer_config.json", lambda t: t.update(add_bos_token="no")),
        r"tokenizer_config.json: add_bos_token must be true or false, got 'no'",
    ),
    "chat_template a number": (
        edit_json("tokenizer_config.json", lambda t: t.update(chat_template=5)),
        r"tokenizer_config.json: chat_template must be a string or a list of \{name, template\} strings",
    ),
    "negative eos_token_id": (
        edit_json("config.json", lambda c: c.update(eos_token_id=-1)),
        r"config.json: eos_token_id must be a token id \(a non-negative integer\) or a list of them, got -1",
    ),
    "negative bos_token_id": (
        edit_json("config.json", lambda c: c.update(bos_token_id=-1)),
        r"config.json: bos_token_id must be a token id \(a non-negative integer\) or a list of them, got -1",
    ),
    "eos_token_id a string": (
        edit_json("generation_config.json", lambda c: c.update(eos_token_id=[1, "2"])),
        r"generation_config.json: eos_token_id must be a token id .*, got \[1, '2'\]",
    ),
    "header a list": (edit_header(1, lambda h: [h]), r"00001-of-00007.safetensors: the safetensors header must be"),
    "header entry lacks a field": (
        edit_header(1, lambda h: first_entry(h).pop("data_offsets") and None),
        r"must be an object with exactly the fields data_offsets, dtype, shape",
    ),
    "integer dtype": (
        edit_header(1, lambda h: first_entry(h).update(dtype="I32")),
        r"tensor model.embed_tokens.weight has unsupported dtype 'I32'",
    ),
    "negative shape": (
        edit_header(1, lambda h: first_entry(h).update(shape=[-320, -64])),
        r"shape must be a list of non-negative integers",
    ),
    "shape a string": (
        edit_header(1, lambda h: first_entry(h).update(shape="320x64")),
        r"shape must be a list of non-negative integers",
    ),
    "offsets that disagree with the shape": (
        edit_header(1, lambda h: first_entry(h).update(shape=[320, 65])),
        r"data_offsets \[0, 81920\] span 81920 bytes, its F32 \[320, 65\] needs 83200",
    ),
    "overlapping tensors": (
        edit_header(4, lambda h: h["model.layers.0.post_attention_layernorm.weight"].update(data_offsets=[0, 256])),
        r"overlaps the one before",
    ),
    "metadata of numbers": (
        edit_header(1, lambda h: h.update(__metadata__={"format": 1})),
        r"__metadata__ must be an object of strings",
    ),
    "header longer than the file": (
        lambda src: shard(src).write_bytes(struct.pack("<Q", 2**62) + shard(src).read_bytes()[8:]),
        r"safetensors header of 4611686018427387904 bytes in a file of",
    ),
    "shard a pipe": (lambda src: shard(src).unlink() or os.mkfifo(shard(src)), r"is not a regular file"),
    "index a list": (
        lambda src: (src / "model.safetensors.index.json").write_text("[]"),
        r"model.safetensors.index.json must hold a JSON object",
    ),
    "weight_map a list": (
        edit_json("model.safetensors.index.json", lambda i: i.update(weight_map=[])),
        r"weight_map must be an object of tensor name -> shard file name",
    ),
    "weight_map of numbers": (
        edit_json("model.safetensors.index.json", lambda i: i["weight_map"].update({"lm_head.weight": 6})),
        r"weight_map must be an object of tensor name -> shard file name",
    ),
    "shard outside the folder": (
        edit_json("model.safetensors.index.json", lambda i: i["weight_map"].update({"x": "../other.safetensors"})),
        r"weight_map: '../other.safetensors' is not a path inside",
    ),
    "shard by absolute path": (
        edit_json("model.safetensors.index.json", lambda i: i["weight_map"].update({"x": "/etc/passwd"})),
        r"weight_map: '/etc/passwd' is not a path inside",
    ),
    "shard linked out of the folder": (link_shard_out, r"leads outside .* \(through a symbolic link\)"),
    "index a loop of symbolic links": (
        lambda src: (
            (src / "model.safetensors.index.json").unlink()
            or (src / "model.safetensors.index.json").symlink_to("model.safetensors.index.json")
        ),
        r"model.safetensors.index.json cannot be opened: Too many levels of symbolic links",
    ),
    "shard a loop of symbolic links": (
        loop_shard,
        r"model.safetensors.index.json: weight_map: 'model-00002-of-00007.safetensors' is a loop of symbolic links",
    ),
    "nan weight": (as_bin(set_nan), r"hf: tensor model.norm.weight holds NaN or infinite values"),
    "integer weight in a .bin": (
        as_bin(lambda s: s.update({"model.norm.weight": s["model.norm.weight"].long()})),
        r"pytorch_model.bin: tensor model.norm.weight has dtype torch.int64",
    ),
    "text file as a .bin": (
        lambda src: as_bin(lambda s: None)(src) or (src / "pytorch_model.bin").write_text("hi"),
        r"pytorch_model.bin is not a torch.save archive",
    ),
}


@pytest.mark.parametrize("name", list(BAD_HF_SOURCES))
def test_bad_source_is_one_line_naming_the_file(name, pristine_sharded, tmp_path):
    edit, message = BAD_HF_SOURCES[name]
    src = tmp_path / "hf"
    shutil.copytree(pristine_sharded, src)
    edit(src)
    with pytest.raises((ValueError, OSError)) as info:
        convert_hf(src, tmp_path / "out")
    text = str(info.value)
    assert str(src) in text and len(text.splitlines()) == 1, text
    assert re.search(message, text), text
    assert not (tmp_path / "out").exists()


def claim_gigabytes(src):
    """Make ``src`` (one model.safetensors) describe a model of 4096 wide and 131072 tokens (5.8 GB of float32)
    in a sparse file of that size that holds no data."""
    path = src / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__", None)
    sizes = {64: 4096, 32: 2048, 96: 11008, 320: 131072}
    position = 0
    for name in sorted(header):
        shape = [sizes[n] for n in header[name]["shape"]]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [position, position + 4 * math.prod(shape)]}
        position += 4 * math.prod(shape)
    text = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + position)
    edit_json(
        "config.json", lambda c: c.update(hidden_size=4096, intermediate_size=11008, vocab_size=131072, head_dim=1024)
    )(src)


def test_a_sparse_file_claiming_more_than_the_memory_is_one_error_line(tmp_path, capsys, monkeypatch):
    """The converted weights are held in memory until written: a model larger than the memory available is
    refused before any tensor is read (the out-of-memory killer would end the process without a word)."""
    src = tmp_path / "hf"
    save_hf_llama(src)
    claim_gigabytes(src)
    capsys.readouterr()  # transformers' progress bars
    monkeypatch.setattr("gpt_fast.convert.layout.available_memory", lambda: 2 << 30)
    code, _, err = run_cli(["convert", str(src), "--output_dir", str(tmp_path / "out")], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert re.search(r"error: .*hf: converting needs about 5.4 GiB of memory .* 2.0 GiB are available", err), err
    assert not (tmp_path / "out").exists()


def test_the_recommended_sampling_is_recorded_and_used_where_none_is_given(hf_dir, tmp_path):
    from gpt_fast import Engine, EngineOptions

    (hf_dir / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    convert_hf(hf_dir, tmp_path / "out")
    recorded = json.loads((tmp_path / "out" / "config.json").read_text())["generation"]
    assert recorded == {"temperature": 0.6, "top_k": None, "top_p": 0.9, "source": "generation_config.json"}
    engine = Engine.open(tmp_path / "out", EngineOptions(device="cpu"))
    sampling, said = engine.sampling_choice()
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.6, 200, 0.9)
    assert said == ("temperature 0.6 (generation_config.json), top_k 200 (default), top_p 0.9 (generation_config.json)")
    sampling, said = engine.sampling_choice(temperature=1.0, top_k=5)  # the user's values win
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (1.0, 5, 0.9)
    assert said.startswith("temperature 1 (given), top_k 5 (given)")
    assert engine.sampling_choice(temperature=0)[1] == "greedy: temperature 0 (given)"


def test_a_top_k_of_zero_means_the_whole_vocabulary(hf_dir, tmp_path):
    from gpt_fast import Engine, EngineOptions

    (hf_dir / "generation_config.json").write_text(json.dumps({"top_k": 0}))
    convert_hf(hf_dir, tmp_path / "out")
    sampling, said = Engine.open(tmp_path / "out", EngineOptions(device="cpu")).sampling_choice()
    assert sampling.top_k is None and "top_k the whole vocabulary (generation_config.json)" in said


def test_without_a_recommendation_the_defaults_stay(hf_dir, tmp_path):
    from gpt_fast import Engine, EngineOptions

    (hf_dir / "generation_config.json").unlink(missing_ok=True)
    convert_hf(hf_dir, tmp_path / "out")
    config_path = tmp_path / "out" / "config.json"
    config = json.loads(config_path.read_text())
    assert config["generation"] is None
    del config["generation"]  # as written before the field existed
    config_path.write_text(json.dumps(config))
    sampling, said = Engine.open(tmp_path / "out", EngineOptions(device="cpu")).sampling_choice()
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.8, 200, 1.0)
    assert said == "temperature 0.8 (default), top_k 200 (default), top_p 1 (default)"


@pytest.mark.parametrize(
    "content, message",
    [
        ({"temperature": "hot"}, "field temperature has the wrong type"),
        ({"top_k": 2.5}, "field top_k has the wrong type"),
        ({"top_p": 1.5}, r"generation.top_p must be in \(0, 1\], got 1.5"),
        ({"temperature": -1}, "generation.temperature must be a finite number >= 0"),
    ],
)
def test_a_bad_generation_config_is_refused_naming_the_file(hf_dir, tmp_path, content, message):
    (hf_dir / "generation_config.json").write_text(json.dumps(content))
    convert_fails(hf_dir, tmp_path / "out", f"generation_config.json: .*{message}")
