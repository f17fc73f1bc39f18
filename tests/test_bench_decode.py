"""The peer benchmark's CPU path on a tiny shape: ours and transformers on identical weights."""

import re

import pytest
import torch

from gpt_fast.bench.decode import (
    hf_runners,
    quant_schemes,
    run_benchmark,
    scheme_bytes_per_token,
    share_repacked_weights,
)
from gpt_fast.bench.options import DecodeBenchOptions
from gpt_fast.convert.hf_config import hf_config_dict
from gpt_fast.convert.layout import split_tensors
from gpt_fast.convert.random_init import random_weights
from gpt_fast.kernels.cpu_gemv import cpu_kernels_usable
from gpt_fast.model.config import QuantConfig
from gpt_fast.model.shapes import get_shape


def test_hf_layout_gives_transformers_the_same_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpt_fast.model.transformer import Transformer

    shape = get_shape("tiny")
    state = random_weights(shape, torch.float32, seed=0)
    ours = Transformer(shape)
    ours.load_state_dict(state)
    theirs = LlamaForCausalLM(LlamaConfig(**hf_config_dict(shape)))
    theirs.load_state_dict(split_tensors(state, shape))
    tokens = torch.randint(0, shape.vocab_size, (1, 12))
    ours.setup_caches(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens, torch.arange(12)), theirs(tokens).logits, rtol=1e-4, atol=1e-4)


def tiny_benchmark(lines, **kwargs):
    """run_benchmark on the tiny shape on the CPU, eager, a few tokens."""
    settings = {"mode": "none", "dtype": torch.float32, "prompt_tokens": 5, "new_tokens": 8, "ttft_tokens": 16}
    return run_benchmark("tiny", torch.device("cpu"), **({**settings, "repeats": 2} | kwargs), write=lines.append)


def test_table_on_the_cpu(capsys):
    lines = []
    rows = tiny_benchmark(lines, peers=True)
    assert [r.name.split()[0] for r in rows] == ["gpt-fast", "transformers", "transformers"]
    assert all(r.tokens_per_sec > 0 and r.ttft_ms > 0 and r.compile_seconds > 0 for r in rows)
    assert lines[0].startswith("measured: copy bandwidth ") and lines[0].endswith(" GB/s")  # before any row
    table = lines[-1].splitlines()
    assert table[0].startswith("| implementation | compile (s) | tok/s | × first | weights read (GB) | GB/s |")
    assert len(table) == 2 + len(rows)


def test_a_row_out_of_memory_loses_only_itself(monkeypatch):
    import gpt_fast.bench.decode as bench_decode

    real = bench_decode.hf_runners

    def eager_runs_out(state, shape, static, device, dtype, sampling):
        if not static:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.75 GiB.\nmore detail")
        return real(state, shape, static, device, dtype, sampling)

    monkeypatch.setattr(bench_decode, "hf_runners", eager_runs_out)
    lines = []
    rows = tiny_benchmark(lines, peers=True)
    assert [r.name.split()[0] for r in rows] == ["gpt-fast", "transformers"]
    failed = [line for line in lines if line.startswith("not measured: ")]
    assert len(failed) == 1
    assert failed[0].endswith(" eager: out of memory (CUDA out of memory. Tried to allocate 1.75 GiB.)")
    assert len(lines[-1].splitlines()) == 2 + len(rows)


def test_hf_runner_generates_exactly_the_requested_tokens():
    shape = get_shape("tiny")
    run, _ = hf_runners(random_weights(shape, torch.float32, seed=1), shape, False, torch.device("cpu"), torch.float32)
    run([1, 2, 3], 4)


def test_quantized_rows_on_the_same_weights():
    lines = []
    schemes = quant_schemes(("int8", "int4"), 32)
    rows = tiny_benchmark(lines, new_tokens=4, repeats=1, peers=False, quantize=schemes)
    names = [r.name for r in rows]
    assert names[:2] == ["gpt-fast none", "gpt-fast none int8"] and names[-1] == "gpt-fast none int4-g32"
    assert names[2].startswith("upstream-style int8")
    shape = get_shape("tiny")
    assert rows[1].bytes_per_token == scheme_bytes_per_token(shape, schemes[0], torch.float32)
    assert rows[3].bytes_per_token == scheme_bytes_per_token(shape, schemes[1], torch.float32)
    assert rows[3].bytes_per_token < rows[1].bytes_per_token < rows[0].bytes_per_token / 2
    assert len(lines[-1].splitlines()) == 2 + len(rows)


def test_quantized_rows_once_per_quantized_kernel(capsys):
    """``--quant_kernels``: ours once per kernel, named by it, on the same weights; a kernel that is not one is an
    error of the option."""
    from gpt_fast.cli.main import main

    lines = []
    rows = tiny_benchmark(
        lines,
        new_tokens=4,
        repeats=1,
        peers=False,
        quantize=quant_schemes(("int8",), 32),
        quant_kernels=["dequant", "aten"],
    )
    names = [r.name for r in rows]
    assert names[1:3] == ["gpt-fast none int8 dequant", "gpt-fast none int8 aten"]
    assert rows[1].bytes_per_token == rows[2].bytes_per_token
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "decode", "--quantize", "int8", "--quant_kernels", "cpp,fast"])
    assert exit_info.value.code == 2
    assert re.search("--quant_kernels 'fast' is not one of auto, triton, gemlite, cpp, cpp-q8", capsys.readouterr().err)


def test_a_rows_engines_share_their_repacked_weights():
    """Layers repacked at load (here int8 for the triton kernel, bf16) each make their own ``words``; the second
    engine's layers then take the first one's, so that a row holds one copy of the weights."""
    from torch import nn

    from gpt_fast.quant.layers import Int8Linear
    from gpt_fast.quant.schemes import quantize_int8

    q, scales = quantize_int8(torch.randn(8, 64), torch.bfloat16)
    models = []
    for _ in range(2):
        layer = Int8Linear(64, 8, QuantConfig("int8"), bias=False)
        layer.load_state_dict({"weight": q, "scales": scales}, assign=True)
        layer.prepare("triton")
        models.append(nn.Sequential(nn.Identity(), layer))
    assert models[1][1].words is not models[0][1].words
    share_repacked_weights(models)
    assert models[1][1].words is models[0][1].words
    assert [name for name, _ in models[1].named_parameters()] == ["1.scales", "1.words"]


def test_schemes_are_checked(capsys):
    from gpt_fast.cli.main import main

    assert quant_schemes((), 128) == []
    assert quant_schemes(("int4",), 64) == [QuantConfig("int4", 64)]
    with pytest.raises(ValueError, match="^quantize 'fp8' is not one of int8, int4"):
        DecodeBenchOptions(quantize=("int8", "fp8"))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "decode", "--quantize", "int8,fp8"])
    assert exit_info.value.code == 2
    assert re.search("--quantize 'fp8' is not one of int8, int4", capsys.readouterr().err)


def shrunk(name: str):
    """A registered shape's features at a tiny size."""
    import dataclasses

    shape = get_shape(name)
    layers = 3
    types = shape.layer_types[:2] + shape.layer_types[-1:]  # Gemma: two sliding layers, then a full one
    scale = 64**0.5 if shape.embedding_scale != 1.0 else 1.0
    return dataclasses.replace(
        shape,
        block_size=64,
        vocab_size=300,
        n_layer=layers,
        n_head=4,
        n_local_heads=2,
        dim=64,
        head_dim=16,
        intermediate_size=32,
        embedding_scale=scale,
        layer_types=types,
        sliding_window=4 if types else None,
        n_experts=min(shape.n_experts, 4),
        n_active_experts=min(shape.n_active_experts, 2),
        shared_expert_size=48 if shape.shared_expert_size else 0,
    )


FAMILY_SHAPES = [
    "qwen2.5-7b",
    "qwen3-8b",
    "gemma-2-9b",
    "gemma-3-1b",
    "phi-3-mini-4k",
    "mixtral-8x7b",
    "qwen1.5-moe-a2.7b",
    "qwen3-30b-a3b",
]


@pytest.mark.parametrize("name", FAMILY_SHAPES)
@torch.no_grad()
def test_peer_is_the_same_model_for_every_family(name):
    from gpt_fast.bench.decode import hf_model
    from gpt_fast.model.transformer import Transformer

    shape = shrunk(name)
    state = random_weights(shape, torch.float32, seed=0)
    state = {n: t * 10 if t.dim() > 1 else t for n, t in state.items()}  # larger than 0.02: real differences
    ours = Transformer(shape)
    ours.load_state_dict(state)
    theirs = hf_model(dict(state), shape, torch.device("cpu"))
    theirs.config._attn_implementation = "eager"
    tokens = torch.randint(0, shape.vocab_size, (1, 12))
    ours.setup_caches(1, 16)
    torch.testing.assert_close(ours(tokens, torch.arange(12)), theirs(tokens).logits, rtol=1e-4, atol=1e-4)


def test_every_registered_shape_converts_back_from_its_hf_config():
    from gpt_fast.convert.hf_config import model_config_from_hf
    from gpt_fast.model.shapes import SHAPES

    for name, shape in SHAPES.items():
        assert model_config_from_hf(hf_config_dict(shape), name) == shape, name


def test_the_decode_kernels_are_named_and_checked():
    """On the CPU ``auto`` is the PyTorch code for four of them and, where our C++ kernels build, ``cpp`` for the
    layers: one row, the kernels named in the header; Triton is refused."""
    lines = []
    rows = tiny_benchmark(
        lines,
        new_tokens=2,
        repeats=1,
        peers=False,
        attention_kernels=["auto", "torch"],
        activation_kernels=["auto"],
        linear_kernels=["auto", "torch"],
        sampling_kernels=["auto", "torch"],
    )
    assert [r.name for r in rows] == ["gpt-fast none"]
    layers = "cpp" if cpu_kernels_usable() else "torch"
    assert lines[-2].endswith(
        f"our decode's attention kernel: torch; activation kernel: torch; layers kernel: {layers}; "
        "linear kernel: torch; sampling kernel: torch; our compiled steps: the whole step compiled, kernels tuned by "
        "coordinate descent"
    )
    with pytest.raises(ValueError, match="the triton attention kernel needs a CUDA GPU"):
        tiny_benchmark(lines, peers=False, attention_kernels=["triton"])
    with pytest.raises(ValueError, match="the triton activation kernel needs a CUDA GPU"):
        tiny_benchmark(lines, peers=False, activation_kernels=["triton"])
    with pytest.raises(ValueError, match="the triton layers kernel needs a CUDA GPU"):
        tiny_benchmark(lines, peers=False, layers_kernels=["triton"])
    with pytest.raises(ValueError, match="the triton linear kernel needs a CUDA GPU"):
        tiny_benchmark(lines, peers=False, linear_kernels=["triton"])
    with pytest.raises(ValueError, match="the triton sampling kernel needs a CUDA GPU"):
        tiny_benchmark(lines, peers=False, sampling_kernels=["triton"])


def test_regional_compile_is_named_in_the_rows_and_the_summary():
    lines = []
    rows = tiny_benchmark(lines, new_tokens=4, repeats=1, peers=False, regional_compile=True)
    assert [r.name for r in rows] == ["gpt-fast none regional"]
    assert lines[-2].endswith(
        "our compiled steps: one layer compiled and reused (regional), kernels tuned by coordinate descent"
    )


def test_heuristic_kernels_are_named_in_the_rows_and_the_summary():
    lines = []
    rows = tiny_benchmark(lines, new_tokens=4, repeats=1, peers=False, kernel_tuning="heuristic")
    assert [r.name for r in rows] == ["gpt-fast none heuristic"]
    assert lines[-2].endswith("our compiled steps: the whole step compiled, kernels as inductor picks them")


def test_each_row_is_built_as_often_as_asked(monkeypatch):
    import gpt_fast.bench.decode as bench_decode

    built = []
    real = bench_decode.ours_runners

    def counted(*args, **kwargs):
        built.append(args[1:])
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_decode, "ours_runners", counted)
    lines = []
    rows = tiny_benchmark(lines, new_tokens=4, repeats=1, peers=False, builds=3)
    assert len(built) == 3 and len(rows) == 1
    low, high = rows[0].build_range
    assert low <= rows[0].tokens_per_sec <= high
    assert f"| {rows[0].tokens_per_sec:.1f} ({low:.1f}–{high:.1f}) |" in lines[-1]
    assert lines[-2].endswith("; each row built 3 times, tok/s their median (range)")
    assert tiny_benchmark([], new_tokens=4, repeats=1, peers=False)[0].build_range is None


def test_builds_below_one_are_refused(capsys):
    from gpt_fast.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "decode", "--shape", "tiny", "--device", "cpu", "--builds", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("error: --builds must be at least 1, not 0")


def test_quantize_table_keeps_a_tied_table_as_the_default_models_cpu_form_does():
    """``--quantize_table``: every quantized row holds a tied embedding table as int8 in groups of 32 (about a
    quarter of its float32 bytes, counted once as the output projection), on shapes that tie it only."""
    from gpt_fast.model.config import EmbeddingQuant

    assert quant_schemes(("int4",), 32, table=True) == [QuantConfig("int4", 32, embeddings=EmbeddingQuant("int8", 32))]
    shape = get_shape("smollm2-135m")
    plain, table = QuantConfig("int4", 32), quant_schemes(("int4",), 32, table=True)[0]
    saved = scheme_bytes_per_token(shape, plain, torch.float32) - scheme_bytes_per_token(shape, table, torch.float32)
    float_table = shape.vocab_size * shape.dim * 4
    assert 0.7 * float_table < saved < 0.8 * float_table
    DecodeBenchOptions(shape="smollm2-135m", quantize=("int8",), quantize_table=True)
    for shape_name, quantize in [("llama-2-7b", ("int8",)), ("smollm2-135m", ())]:
        with pytest.raises(ValueError, match="quantize_table goes with quantize, on a shape whose embedding table"):
            DecodeBenchOptions(shape=shape_name, quantize=quantize, quantize_table=True)
