"""`gpt-fast quantize` and `convert --quantize` end to end on tiny checkpoints: what they write, that it loads and
generates (eager and compiled alike), how close it stays to the float model, and every bad input in one line."""

import json
import re

import pytest
import torch

from gpt_fast.checkpoint.load import check_checkpoint
from gpt_fast.cli.main import main
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.model.config import QuantConfig, load_checkpoint_config
from gpt_fast.model.shapes import get_shape
from tests.tiny import our_greedy, save_hf_llama

SCHEMES = {
    "int8": ["--mode", "int8"],
    "int4-g32": ["--mode", "int4", "--group_size", "32", "--calibrate", "none"],
    "int4-output": ["--mode", "int4", "--quantize_output"],  # the defaults: groups of 64, GPTQ
}


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny") / "f", dtype=torch.float32).parent


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    out = {}
    for name, args in SCHEMES.items():
        folder = tmp_path_factory.mktemp(name) / "q"
        with pytest.raises(SystemExit) as exit_info:
            main(["quantize", "--checkpoint_path", str(source), *args, "--output_dir", str(folder)])
        assert exit_info.value.code == 0
        out[name] = folder
    return out


def test_config_json_records_the_scheme(quantized):
    assert load_checkpoint_config(quantized["int8"]).quantization == QuantConfig("int8")
    assert load_checkpoint_config(quantized["int4-g32"]).quantization == QuantConfig("int4", 32)
    assert load_checkpoint_config(quantized["int4-output"]).quantization == QuantConfig("int4", 64, True, method="gptq")
    config = json.loads((quantized["int8"] / "config.json").read_text())
    assert config["quantization"] == {
        "mode": "int8",
        "group_size": None,
        "output": False,
        "method": "rtn",
        "keep_float": [],
    }
    assert config["source"]["kind"] == "quantized" and config["dtype"] == "float32"
    for folder in quantized.values():
        check_checkpoint(folder)  # what generate checks before reading the weights
        assert {p.name for p in folder.iterdir()} == {"config.json", "model.pth", "tokenizer.json"}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantized_logits_stay_close_to_the_float_model(name, source, quantized):
    """Relative error of the last position's logits: int8 a fraction of a percent, int4 a few percent (random
    weights quantize worse than trained ones, whose distributions are narrower)."""
    prompt = list(range(1, 33))
    logits = {}
    for key, folder in (("float", source), ("quantized", quantized[name])):
        engine = Engine.load(folder)
        engine.model.setup_caches(1, 64)
        with torch.no_grad():
            logits[key] = engine.model(torch.tensor([prompt]), torch.arange(len(prompt)))[0, -1].double()
    error = ((logits["quantized"] - logits["float"]).norm() / logits["float"].norm()).item()
    assert error < (0.01 if name == "int8" else 0.15)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMES))
def test_generates_the_same_tokens_compiled_and_eager(name, quantized):
    tokens = {}
    for mode in ("none", "default"):
        engine = Engine.open(quantized[name], EngineOptions(compile=mode))
        engine.load_weights()
        tokens[mode] = our_greedy(engine, engine.encode("def quicksort(arr):"), 16)
    assert tokens["default"] == tokens["none"] and len(tokens["none"]) == 16


def test_generate_and_bench_figures_use_the_quantized_bytes(quantized, source, capsys):
    code, out, err = run(
        ["generate", "--checkpoint_path", str(quantized["int8"]), "--max_new_tokens", "8", "--num_samples", "1"],
        capsys,
    )
    assert code == 0, err
    assert "Sample 1/1: 8 tokens" in out
    float_bytes = Engine.load(source).weight_bytes_per_token
    int8_bytes = Engine.load(quantized["int8"]).weight_bytes_per_token
    int4_bytes = Engine.load(quantized["int4-output"]).weight_bytes_per_token
    assert int4_bytes < int8_bytes < 0.5 * float_bytes


KEPT = "layers.1.attention.wo"


def test_convert_quantize_does_both_in_one_go(tmp_path, capsys):
    """From a Hugging Face folder: the same tensors as converting, then quantizing (a layer kept in float by both)."""
    save_hf_llama(tmp_path / "hf")
    code, out, err = run(["convert", str(tmp_path / "hf"), "--output_dir", str(tmp_path / "f")], capsys)
    assert code == 0, err
    code, out, err = run(
        [
            "convert",
            str(tmp_path / "hf"),
            "--output_dir",
            str(tmp_path / "q"),
            "--quantize",
            "int4",
            "--group_size",
            "32",
            "--keep_float",
            KEPT,
        ],
        capsys,
    )
    assert code == 0, err
    expected = {"mode": "int4", "group_size": 32, "output": False, "method": "rtn", "keep_float": (KEPT,)}
    assert f"Quantization {expected}" in out
    code, out, err = run(
        ["quantize", "--checkpoint_path", str(tmp_path / "f"), "--mode", "int4", "--group_size", "32"]
        + ["--calibrate", "none", "--keep_float", KEPT, "--output_dir", str(tmp_path / "q2")],
        capsys,
    )
    assert code == 0, err
    one, two = (torch.load(tmp_path / name / "model.pth", weights_only=True) for name in ("q", "q2"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert one[f"{KEPT}.weight"].dtype == torch.float32 and one["layers.0.attention.wo.weight"].dtype == torch.uint8


BAD = {
    "group size 7": (["--mode", "int4", "--group_size", "7"], "--group_size '7' is not one of 32, 64, 128, 256"),
    "group size with int8": (["--mode", "int8", "--group_size", "64"], "--group_size goes with int4"),
    "no mode": ([], "Missing option '--mode'"),
    "unknown mode": (["--mode", "int3"], "--mode 'int3' is not one of int8, int4"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_options_are_one_line(name, source, tmp_path, capsys):
    args, message = BAD[name]
    code, out, err = run(["quantize", "--checkpoint_path", str(source), *args, "--output_dir", str(tmp_path)], capsys)
    assert code != 0 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert message in err
    assert not list(tmp_path.iterdir())


def test_an_odd_input_width_cannot_be_packed(tmp_path, capsys):
    odd = get_shape("tiny").__class__(**{**get_shape("tiny").__dict__, "intermediate_size": 161})
    source = make_random_checkpoint(odd, tmp_path / "odd", dtype=torch.float32).parent
    code, _, err = run(
        ["quantize", "--checkpoint_path", str(source), "--mode", "int4", "--output_dir", str(tmp_path / "q")], capsys
    )
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert (
        "config.json: int4 quantization packs two input columns per byte: model.intermediate_size (161) is odd" in err
    )
    assert not (tmp_path / "q").exists()
    code, _, err = run(
        ["quantize", "--checkpoint_path", str(source), "--mode", "int8", "--output_dir", str(tmp_path / "q")], capsys
    )
    assert code == 0, err  # int8 takes any width


def test_an_already_quantized_checkpoint_is_refused(quantized, tmp_path, capsys):
    code, _, err = run(
        [
            "quantize",
            "--checkpoint_path",
            str(quantized["int8"]),
            "--mode",
            "int4",
            "--output_dir",
            str(tmp_path / "q"),
        ],
        capsys,
    )
    assert code == 1 and len(err.strip().splitlines()) == 1
    assert re.search(r"config.json: the checkpoint is already quantized \(int8\)", err)


def test_the_output_must_differ_from_the_source(source, capsys):
    code, _, err = run(
        ["quantize", "--checkpoint_path", str(source), "--mode", "int8", "--output_dir", str(source)], capsys
    )
    assert code == 1 and "the output folder must differ from the checkpoint being quantized" in err


def edit_weights(folder, edit):
    state = torch.load(folder / "model.pth", weights_only=True)
    edit(state)
    torch.save(state, folder / "model.pth")


TAMPERED = {
    "scales of the wrong dtype": (
        lambda s: s.update({"layers.0.attention.wo.scales": s["layers.0.attention.wo.scales"].double()}),
        r"tensor layers.0.attention.wo.scales is torch.float64, config.json says dtype float32",
    ),
    "float weights in a quantized layer": (
        lambda s: s.update({"layers.0.attention.wo.weight": s["layers.0.attention.wo.weight"].float()}),
        r"tensor layers.0.attention.wo.weight is torch.float32, config.json says the quantized dtype int8",
    ),
    "int8 where float belongs": (
        lambda s: s.update({"norm.weight": s["norm.weight"].to(torch.int8)}),
        r"tensor norm.weight is torch.int8, config.json says dtype float32",
    ),
    "scales renamed": (
        lambda s: s.update({"layers.1.feed_forward.w2.scale": s.pop("layers.1.feed_forward.w2.scales")}),
        r"missing tensor\(s\): layers.1.feed_forward.w2.scales; unexpected tensor\(s\): layers.1.feed_forward.w2.scale",
    ),
    "scales missing": (
        lambda s: s.pop("layers.1.feed_forward.w2.scales"),
        r"model.pth holds 22 tensors, a model of 2 layers \(n_layer\) has 23",
    ),
    "scales of the wrong shape": (
        lambda s: s.update({"layers.0.attention.wo.scales": s["layers.0.attention.wo.scales"][:-1].clone()}),
        r"tensor layers.0.attention.wo.scales has shape \[63\], config.json expects \[64\]",
    ),
    "NaN scales": (
        lambda s: s["layers.0.attention.wo.scales"].__setitem__(0, float("nan")),
        r"tensor layers.0.attention.wo.scales holds NaN or infinite values",
    ),
}


@pytest.mark.parametrize("name", list(TAMPERED))
def test_a_tampered_quantized_checkpoint_is_refused(name, quantized, tmp_path, capsys):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(quantized["int8"], folder)
    edit, message = TAMPERED[name]
    edit_weights(folder, edit)
    code, _, err = run(["generate", "--checkpoint_path", str(folder), "--max_new_tokens", "2"], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err


def test_int4_weights_of_another_dtype_are_refused_before_reading(tmp_path):
    """An integer dtype a float checkpoint may not hold is still refused there."""
    source = make_random_checkpoint(get_shape("tiny"), tmp_path / "f", dtype=torch.float32).parent
    edit_weights(source, lambda s: s.update({"norm.weight": s["norm.weight"].to(torch.uint8)}))
    with pytest.raises(ValueError, match="tensor norm.weight has dtype torch.uint8; weights must be one of"):
        check_checkpoint(source)
