"""`gpt-fast quantize --calibrate gptq` on a tiny checkpoint: what config.json records, that the stored tensors are
the ordinary int4 ones (loaded and run by the same layers and kernels), layers kept in float, the calibration text,
and every bad input in one line."""

import json
from pathlib import Path

import pytest
import torch

from gpt_fast.checkpoint.load import check_checkpoint, model_from_state
from gpt_fast.cli.main import main
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.engine.engine import Engine
from gpt_fast.jobs.evaluate import default_text
from gpt_fast.model.config import QuantConfig, load_checkpoint_config
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import weight_bytes_per_token
from gpt_fast.quant.calibrate import CALIBRATION_MODULES, Calibration, calibration_rows, gptq_parts, stdlib_docstrings
from gpt_fast.quant.gptq import asymmetric_target, gptq_int4, hessian
from gpt_fast.quant.layers import Int4Linear
from gpt_fast.quant.layout import stored_size
from gpt_fast.quant.schemes import dequantize_int4
from tests.test_quant_quantize import run
from tests.tiny import our_greedy

KEPT = "layers.0.feed_forward.w2"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny") / "f", dtype=torch.float32).parent


@pytest.fixture(scope="module")
def calibrated(source, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gptq") / "q"
    args = ["--mode", "int4", "--group_size", "32", "--calibrate", "gptq", "--calibration_tokens", "1024"]
    args += ["--act_order", "--asymmetric", "--keep_float", KEPT, "--quantize_output"]
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "--checkpoint_path", str(source), *args, "--output_dir", str(folder)])
    assert exit_info.value.code == 0
    return folder


def test_config_json_records_the_method_the_kept_layers_and_the_calibration(calibrated):
    quant = load_checkpoint_config(calibrated).quantization
    assert quant == QuantConfig("int4", 32, output=True, method="gptq", keep_float=(KEPT,))
    assert quant.name == "int4-g32-gptq (1 layers in float)"
    source = json.loads((calibrated / "config.json").read_text())["source"]
    assert source["calibration"] == {
        "text": "stdlib docstrings (gpt_fast.quant.calibrate.CALIBRATION_MODULES)",
        "tokens": 1024,
        "act_order": True,
        "damp": 0.01,
        "asymmetric": True,
    }
    check_checkpoint(calibrated)


def test_the_stored_tensors_run_through_the_int4_layers_unchanged(calibrated, source):
    """The layer's product is the plain product with its dequantized stored tensors; the kept layer holds the
    source's float weight bit for bit; the counted bytes are the file's."""
    state = torch.load(calibrated / "model.pth", weights_only=True)
    float_state = torch.load(source / "model.pth", weights_only=True)
    assert torch.equal(state[f"{KEPT}.weight"], float_state[f"{KEPT}.weight"])
    assert state["layers.1.feed_forward.w2.weight"].dtype == torch.uint8
    assert state["output.weight"].dtype == torch.uint8  # tied embeddings: the output projection stored apart
    engine = Engine.load(calibrated)
    layer = engine.model.layers[1].feed_forward.w2
    assert isinstance(layer, Int4Linear)
    x = torch.randn(3, layer.weight.shape[1] * 2)
    parts = [state[f"layers.1.feed_forward.w2.{name}"] for name in ("weight", "scales", "zeros")]
    expected = x.double() @ dequantize_int4(*parts, 32).double().T
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-4, atol=1e-4)
    assert isinstance(engine.model.layers[0].feed_forward.w2, torch.nn.Linear)
    config = load_checkpoint_config(calibrated)
    size = sum(t.numel() * t.element_size() for t in state.values())
    assert stored_size(config.model, config.quantization, torch.float32) == (len(state), size)
    embedding = engine.model.tok_embeddings.weight
    assert weight_bytes_per_token(engine.model) == size - embedding.numel() * embedding.element_size()
    assert len(our_greedy(engine, engine.encode("def quicksort(arr):"), 8)) == 8


def quantize_cli(source, folder, *args: str) -> Path:
    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "--checkpoint_path", str(source), "--mode", "int4", *args, "--output_dir", str(folder)])
    assert exit_info.value.code == 0
    return folder


def logits_error(folder, reference: torch.Tensor, rows: torch.Tensor) -> float:
    """Relative error of a checkpoint's logits on ``rows`` [B, T] against ``reference`` [B, T, V]."""
    engine = Engine.load(folder)
    engine.model.setup_caches(*rows.shape)
    with torch.no_grad():
        logits = engine.model(rows, torch.arange(rows.shape[1])).double()
    return ((logits - reference).norm() / reference.norm()).item()


def test_the_default_recipe_comes_closer_to_the_float_model_than_round_to_nearest(source, tmp_path):
    """`quantize --mode int4` with no other option is GPTQ with act-order and asymmetric calibration on the
    default calibration text; on the same weights and group size, its logits on text it was not calibrated on (the
    eval text's) are closer to the float model's than round-to-nearest's (``--calibrate none``), by a clear margin,
    and each of its parts (act-order, asymmetric calibration) can be turned off."""
    default = quantize_cli(source, tmp_path / "default", "--group_size", "32")
    recorded = json.loads((default / "config.json").read_text())
    assert recorded["quantization"]["method"] == "gptq"
    assert recorded["source"]["calibration"]["act_order"] and recorded["source"]["calibration"]["asymmetric"]
    rounded = quantize_cli(source, tmp_path / "rtn", "--group_size", "32", "--calibrate", "none")
    assert load_checkpoint_config(rounded).quantization == QuantConfig("int4", 32)
    plain = quantize_cli(source, tmp_path / "plain", "--group_size", "32", "--no_act_order", "--no_asymmetric")
    assert json.loads((plain / "config.json").read_text())["source"]["calibration"]["act_order"] is False
    engine = Engine.load(source)
    rows = torch.tensor(engine.encode(default_text())[: 4 * 128]).reshape(4, 128)
    engine.model.setup_caches(*rows.shape)
    with torch.no_grad():
        reference = engine.model(rows, torch.arange(rows.shape[1])).double()
    errors = {name: logits_error(folder, reference, rows) for name, folder in [("default", default), ("rtn", rounded)]}
    assert errors["default"] < 0.8 * errors["rtn"], errors


def linear_inputs(model: torch.nn.Module, rows: torch.Tensor, prefixes: list[str]) -> dict[str, torch.Tensor]:
    """The inputs [B, T, K] each of the linear layers ``prefixes`` of ``model`` gets in a plain forward pass."""
    inputs = {}
    hooks = [
        model.get_submodule(p).register_forward_pre_hook(lambda m, a, p=p: inputs.setdefault(p, a[0].clone()))
        for p in prefixes
    ]
    model.setup_caches(*rows.shape)
    with torch.no_grad():
        model(rows, torch.arange(rows.shape[1]), last_only=True)
    for hook in hooks:
        hook.remove()
    return inputs


@pytest.mark.parametrize("asymmetric", [False, True])
def test_each_layer_is_calibrated_on_what_the_quantized_layers_before_it_give(source, asymmetric):
    """Every layer's GPTQ tensors are those of its float weight (asymmetric: of its target against its inputs in
    the float model) and the Hessian of its inputs in a plain forward pass of the model holding every quantized
    layer's dequantized weights (a layer's inputs depend only on the layers before it), and those differ from the
    float model's inputs (so the check tells the two apart)."""
    config = load_checkpoint_config(source)
    state = torch.load(source / "model.pth", weights_only=True)
    quant = QuantConfig("int4", 32)
    rows = torch.randint(0, config.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    model = model_from_state(config.model, state, cpu, torch.float32)
    parts = gptq_parts(
        model, rows, config.model, quant, torch.float32, Calibration(act_order=False, asymmetric=asymmetric)
    )
    assert len(parts) == 4 * config.model.n_layer
    dequantized = dict(state)
    for prefix, tensors in parts.items():
        dequantized[f"{prefix}.weight"] = dequantize_int4(tensors["weight"], tensors["scales"], tensors["zeros"], 32)
    inputs = linear_inputs(model_from_state(config.model, dequantized, cpu, torch.float32), rows, list(parts))
    float_inputs = linear_inputs(model_from_state(config.model, state, cpu, torch.float32), rows, list(parts))
    for prefix, tensors in parts.items():
        weight = state[f"{prefix}.weight"]
        if asymmetric:
            weight = asymmetric_target(weight, float_inputs[prefix], inputs[prefix])
        expected = gptq_int4(weight, hessian(inputs[prefix]), 32, torch.float32)
        for name, tensor in zip(("weight", "scales", "zeros"), expected, strict=True):
            torch.testing.assert_close(tensors[name], tensor, rtol=0, atol=0, msg=f"{prefix}.{name}")
    last = f"layers.{config.model.n_layer - 1}.feed_forward.w2"
    assert not torch.allclose(float_inputs[last], inputs[last], rtol=1e-3, atol=1e-3)


def test_the_default_calibration_text_is_not_the_eval_text():
    text = stdlib_docstrings()
    assert len(text) > 100_000 and "argparse" in CALIBRATION_MODULES
    topics = default_text()
    paragraphs = {p.strip() for p in text.split("\n\n") if len(p.strip()) > 200}
    assert paragraphs and not any(p in topics for p in paragraphs)


def test_calibration_rows_spread_over_the_text():
    rows = calibration_rows(list(range(10_000)), 2048, 8192, "text")
    assert rows.shape == (4, 512) and rows[0, 0] == 0 and rows[-1, -1] == 9999
    assert calibration_rows(list(range(1000)), 512, 256, "text").shape == (2, 256)  # short context: short rows


BAD = {
    "int8": (["--mode", "int8", "--calibrate", "gptq"], "--calibrate gptq goes with --mode int4"),
    "unknown method": (["--mode", "int4", "--calibrate", "awq"], "--calibrate 'awq' is not one of gptq, none"),
    "too few tokens": (
        ["--mode", "int4", "--calibrate", "gptq", "--calibration_tokens", "100"],
        "--calibration_tokens must be a positive multiple of 512, got 100",
    ),
    "not whole rows": (
        ["--mode", "int4", "--calibrate", "gptq", "--calibration_tokens", "1000"],
        "--calibration_tokens must be a positive multiple of 512, got 1000",
    ),
    "act order unrounded": (
        ["--mode", "int4", "--calibrate", "none", "--act_order"],
        "--act_order and --asymmetric go with --calibrate gptq",
    ),
    "int8 asymmetric": (["--mode", "int8", "--no_asymmetric"], "--act_order and --asymmetric go with --calibrate gptq"),
    "int8 text": (["--mode", "int8", "--calibration_tokens", "512"], "--calibration_tokens, --act_order"),
    "not a projection": (
        ["--mode", "int4", "--keep_float", "tok_embeddings"],
        "--keep_float: 'tok_embeddings' is not a layer's projection (e.g. layers.0.feed_forward.w2)",
    ),
    "beyond the layers": (
        ["--mode", "int4", "--keep_float", "layers.2.attention.wo"],
        "quantization.keep_float: 'layers.2.attention.wo' is beyond the model's layers (model.n_layer = 2)",
    ),
    "named twice": (
        ["--mode", "int4", "--keep_float", "layers.0.attention.wo,layers.0.attention.wo"],
        "--keep_float names a layer twice",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_options_are_one_line(name, source, tmp_path, capsys):
    args, message = BAD[name]
    code, out, err = run(["quantize", "--checkpoint_path", str(source), *args, "--output_dir", str(tmp_path)], capsys)
    assert code != 0 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert message in err
    assert not list(tmp_path.iterdir())


def test_a_bad_calibration_text_is_one_line(source, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Too short to calibrate on.")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    cases = {
        short: f"the calibration text ({short}) has 26 tokens, fewer than the 512 to calibrate on",
        binary: f"--calibration_text {binary} is not valid UTF-8 text",
        tmp_path / "missing.txt": f"missing --calibration_text {tmp_path / 'missing.txt'}",
    }
    for path, message in cases.items():
        args = ["--mode", "int4", "--calibrate", "gptq", "--calibration_text", str(path), "--calibration_tokens", "512"]
        code, _, err = run(
            ["quantize", "--checkpoint_path", str(source), *args, "--output_dir", str(tmp_path / "q")], capsys
        )
        assert code == 1 and len(err.strip().splitlines()) == 1, err
        assert message in err, err
        assert not (tmp_path / "q").exists()
