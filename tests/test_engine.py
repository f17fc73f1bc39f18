"""The Python API: opening before loading, encoding, generating and streaming, engines over in-memory weights,
finding checkpoints, and the README's example run as written."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt_fast import Completion, Engine, EngineOptions, SamplingConfig
from gpt_fast.accel import decode_attention
from gpt_fast.accel.options import KernelOptions
from gpt_fast.cli.main import flag_of
from gpt_fast.convert.random_init import make_random_checkpoint, random_weights
from gpt_fast.kernels import cpu_gemv
from gpt_fast.model.config import QuantConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.quant import products
from gpt_fast.quant.layout import quantize_state
from gpt_fast.util.device import resolve_kv_dtype
from gpt_fast.util.options import OptionError

GREEDY = SamplingConfig(temperature=0)
README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny"), dtype=torch.float32, seed=3)


@pytest.fixture(scope="module")
def smol(smollm2_checkpoint):
    return Engine.load(smollm2_checkpoint, device="cpu")


def test_open_reads_no_weights(tiny):
    engine = Engine.open(tiny, EngineOptions(device="cpu"))
    assert engine.checkpoint_dir == tiny.parent and engine.config.model == get_shape("tiny")
    assert engine.encode("hi") == [256, *b"hi"]
    with pytest.raises(RuntimeError, match="load_weights"):
        engine.model  # noqa: B018 - the property is what is tested
    engine.load_weights()
    assert engine.load_seconds > 0 and engine.model.config == engine.config.model


def test_weights_come_from_the_folder_whose_config_was_read(tiny, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny.parent, folder)
    engine = Engine.open(folder, EngineOptions(device="cpu"))
    folder.rename(tmp_path / "old")
    shutil.copytree(tiny.parent, folder)  # a conversion swapped in another checkpoint meanwhile
    with pytest.raises(ValueError, match="was replaced since it was opened"):
        engine.load_weights()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"compile": "turbo"}, "--compile 'turbo' is not one of"),
        ({"dtype": "int4"}, "--dtype 'int4' is not one of"),
        ({"regional_compile": True, "tp": 2}, "--regional_compile does not run with tensor parallelism"),
        ({"kernel_tuning": "exhaustive"}, "--kernel_tuning 'exhaustive' is not one of coordinate-descent, heuristic"),
        ({"threads": 0}, "--threads must be at least 1, not 0"),
        (
            {"kv_cache_dtype": "int8"},
            "--kv_cache_dtype 'int8' is not one of auto, float32, bfloat16, float16, float8_e4m3fn",
        ),
        ({"batch_invariant": True, "kv_cache_dtype": "float16"}, "--batch_invariant does not combine with --kv_cache"),
        ({"aot_precompile": True}, "--aot_precompile keeps a compiled decode step: give it a --compile mode"),
        ({"aot_precompile": True, "compile": "default", "tp": 2}, "--aot_precompile does not combine with --tp"),
        (
            {"aot_precompile": True, "compile": "default", "regional_compile": True},
            "--aot_precompile does not combine with --regional_compile",
        ),
    ],
)
def test_options_check_themselves(options, message):
    """The library names its options; the command line's flags are the same names."""
    with pytest.raises(OptionError, match=message.replace("--", "")) as error:
        EngineOptions(**options)
    assert message in error.value.naming(flag_of)


def test_generate_gives_text_ids_and_timings(smol):
    (completion,) = smol.generate(prompts=["The capital of France is"], max_new_tokens=8, sampling=GREEDY)
    assert isinstance(completion, Completion) and "Paris" in completion.text
    assert completion.prompt_ids == smol.encode("The capital of France is") and len(completion.ids) == 8
    assert completion.finish_reason == "length" and completion.text == smol.decode(completion.ids)
    assert completion.seconds > completion.ttft_seconds > 0 and completion.tokens_per_sec > 0


def test_a_stop_token_finishes_a_chat_answer(smol):
    (completion,) = smol.generate("What is 2 + 2?", max_new_tokens=100, sampling=GREEDY, chat=True)
    assert completion.finish_reason == "stop" and completion.ids[-1] in smol.tokenizer.stop_ids


def test_stream_pieces_make_the_generated_text(smol):
    prompt = "def quicksort(arr):"
    streamed = "".join(smol.stream(prompt, max_new_tokens=24, sampling=GREEDY))
    (completion,) = smol.generate(prompt, max_new_tokens=24, sampling=GREEDY)
    assert streamed == completion.text


def test_every_prompt_is_checked_before_the_first_is_generated(smol, monkeypatch):
    monkeypatch.setattr(smol, "generate_ids", lambda *a, **k: pytest.fail("generated before checking"))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        smol.generate(["short", "long " * 9000], max_new_tokens=4)


def test_system_message_needs_chat(smol):
    with pytest.raises(ValueError, match="system goes with chat"):
        smol.encode("hi", system="be brief")
    assert smol.encode("hi", chat=True, system="be brief") != smol.encode("hi", chat=True)


def test_engine_over_weights_in_memory_takes_ids():
    shape = get_shape("tiny")
    engine = Engine.from_state(shape, random_weights(shape, torch.float32, seed=0), EngineOptions(device="cpu"))
    result = engine.generate_ids([1, 2, 3], 5, GREEDY)
    assert len(result.tokens[0]) == 5 and engine.stop_ids == ()
    with pytest.raises(RuntimeError, match="no tokenizer"):
        engine.encode("hi")


def test_a_float8_kv_cache_on_the_cpu_is_read_by_our_layers_operator():
    """``kv_cache_dtype="float8_e4m3fn"`` on the CPU: the cache in float8, read by our C++ layers operator where it
    builds (test_cpu_layers compares its logits with the model's code over the same cache), a batch of prompts at
    their own positions decoding the tokens each gives alone."""
    shape = get_shape("tiny")
    state = random_weights(shape, torch.float32, seed=0)
    engine = Engine.from_state(shape, state, EngineOptions(device="cpu", kv_cache_dtype="float8_e4m3fn"))
    layers = "cpp" if cpu_gemv.cpu_kernels_usable() else "torch"
    assert engine.kv_dtype == torch.float8_e4m3fn and engine.kernels.layers == layers
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    alone = [engine.generate_ids(prompt, 8, GREEDY).tokens[0] for prompt in prompts]
    assert engine.model.layers[0].attention.kv_cache.kv.dtype == torch.float8_e4m3fn
    assert [c.ids for c in engine.generate_many_ids(prompts, 8, GREEDY)] == alone


@pytest.mark.skipif(not cpu_gemv.cpu_kernels_usable(), reason="our C++ kernels do not build here")
def test_our_cpp_library_is_built_when_the_weights_are_read_not_at_open(tiny, monkeypatch):
    """Opening only decides (a command's own checks follow it, and a mistake is reported in a moment); the C++
    library, some 20 s to build on a new machine, is loaded as the weights are read."""
    built: list[str] = []
    monkeypatch.setattr(decode_attention, "register_cpp_ops", lambda: built.append("attention"))
    monkeypatch.setattr(products, "register_cpu_ops", lambda: built.append("products"))
    engine = Engine.open(tiny, EngineOptions(device="cpu", kernels=KernelOptions(attention="cpp")))
    assert engine.kernels.attention == "cpp" and built == []
    engine.load_weights()
    assert built == ["attention"]
    shape, quant = get_shape("tiny"), QuantConfig("int8")
    state = quantize_state(random_weights(shape, torch.float32, seed=0), shape, quant, torch.float32)
    options = EngineOptions(device="cpu", kernels=KernelOptions(quant="cpp"))
    assert Engine.from_state(shape, state, options, quant).kernels.quant == "cpp" and set(built[1:]) == {"products"}


@pytest.mark.parametrize(("capability", "hip"), [((8, 0), None), ((8, 9), None), ((9, 0), None), ((8, 0), "6.4.0")])
def test_a_float8_kv_cache_needs_a_gpu_that_converts_float8(monkeypatch, capability, hip):
    """Refused, before any weight is read, on an NVIDIA GPU older than Ada (compute capability 8.9), whose compiled
    steps could not convert it; taken on ROCm, where Triton converts float8 in software where the GPU does not."""
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    gpu = torch.device("cuda")
    if capability < (8, 9) and hip is None:
        with pytest.raises(OptionError, match="kv_cache_dtype float8_e4m3fn needs an NVIDIA GPU of compute capability"):
            resolve_kv_dtype("float8_e4m3fn", torch.bfloat16, gpu)
    else:
        assert resolve_kv_dtype("float8_e4m3fn", torch.bfloat16, gpu) == torch.float8_e4m3fn
    assert resolve_kv_dtype("float16", torch.bfloat16, gpu) == torch.float16


@pytest.mark.parametrize("quant", [None, QuantConfig("int8")], ids=["float", "int8"])
def test_regional_compile_decodes_as_eager(quant):
    shape = get_shape("tiny")
    state = random_weights(shape, torch.float32, seed=0)
    if quant is not None:
        state = quantize_state(state, shape, quant, torch.float32)
    eager = Engine.from_state(shape, state, EngineOptions(device="cpu"), quant)
    torch._dynamo.reset()
    options = EngineOptions(compile="default", device="cpu", regional_compile=True)
    regional = Engine.from_state(shape, state, options, quant)
    assert regional.model.regional_compile and not eager.model.regional_compile
    assert regional.generate_ids([1, 2, 3], 12, GREEDY).tokens == eager.generate_ids([1, 2, 3], 12, GREEDY).tokens


def test_checkpoint_by_org_and_name(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints" / "acme").mkdir(parents=True)
    (tmp_path / "checkpoints" / "acme" / "tiny").symlink_to(tiny.parent)
    assert Engine.open("acme/tiny").checkpoint_dir == Path("checkpoints/acme/tiny")
    with pytest.raises(FileNotFoundError, match="prepare it with: gpt-fast prepare acme/other"):
        Engine.open("acme/other")


def readme_python_example() -> str:
    section = README.read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_python_example_runs_as_written(smollm2_gguf, tmp_path):
    """On the default model (prepared in the test run's own cache, as a user's first `Engine.load()` would)."""
    result = subprocess.run(
        [sys.executable, "-c", readme_python_example()], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_aot_precompile_is_refused_for_several_prompts():
    with pytest.raises(ValueError, match="aot_precompile keeps one prompt's decode step"):
        EngineOptions(compile="default", aot_precompile=True).check_batching()


@pytest.mark.parametrize("as_str", [True, False])
def test_profiled_takes_a_str_or_a_path(tiny, tmp_path, as_str):
    engine = Engine.load(tiny, device="cpu")
    path = tmp_path / "trace.json"
    with engine.profiled(str(path) if as_str else path):
        engine.generate_ids([256, 1, 2], 3, GREEDY)
    assert "gpt_fast::decode" in path.read_text()


def test_profiled_checks_its_path_before_the_block(tiny, tmp_path):
    engine = Engine.open(tiny, EngineOptions(device="cpu"))
    with pytest.raises(FileNotFoundError, match="folder .*missing does not exist"):
        with engine.profiled(str(tmp_path / "missing" / "trace.json")):
            pytest.fail("the block ran")


def test_a_batch_beyond_the_device_memory_is_refused_before_allocating(tiny, monkeypatch):
    engine = Engine.open(tiny, EngineOptions(device="cpu"))
    with pytest.raises(
        ValueError, match=r"^--batch_size 10000000000: the KV cache alone needs .* at most \d+ sequences fit$"
    ):
        engine.check_batch_size(10**10, 3, 10)
    engine.check_batch_size(2, 3, 10)
