"""The peer benchmark's CPU path on a tiny shape: ours and transformers on identical weights."""

import pytest
import torch

from gpt_fast.bench_decode import hf_runners, parse_schemes, run_benchmark, scheme_bytes_per_token
from gpt_fast.config import QuantConfig
from gpt_fast.convert.hf_config import hf_config_dict
from gpt_fast.convert.layout import split_tensors
from gpt_fast.convert.random_init import random_weights
from gpt_fast.shapes import get_shape


def test_hf_layout_gives_transformers_the_same_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpt_fast.model import Transformer

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
    table = lines[-1].splitlines()
    assert table[0].startswith("| implementation | compile (s) | tok/s | × first | weights read (GB) | GB/s |")
    assert len(table) == 2 + len(rows)


def test_hf_runner_generates_exactly_the_requested_tokens():
    shape = get_shape("tiny")
    run, _ = hf_runners(random_weights(shape, torch.float32, seed=1), shape, False, torch.device("cpu"), torch.float32)
    run([1, 2, 3], 4)


def test_quantized_rows_on_the_same_weights():
    lines = []
    schemes = parse_schemes("int8,int4", 32)
    rows = tiny_benchmark(lines, new_tokens=4, repeats=1, peers=False, quantize=schemes)
    names = [r.name for r in rows]
    assert names[:2] == ["gpt-fast none", "gpt-fast none int8"] and names[-1] == "gpt-fast none int4-g32"
    assert names[2].startswith("upstream-style int8")
    shape = get_shape("tiny")
    assert rows[1].bytes_per_token == scheme_bytes_per_token(shape, schemes[0], torch.float32)
    assert rows[3].bytes_per_token == scheme_bytes_per_token(shape, schemes[1], torch.float32)
    assert rows[3].bytes_per_token < rows[1].bytes_per_token < rows[0].bytes_per_token / 2
    assert len(lines[-1].splitlines()) == 2 + len(rows)


def test_schemes_are_checked():
    assert parse_schemes("", 128) == []
    assert parse_schemes("int4", 64) == [QuantConfig("int4", 64)]
    with pytest.raises(ValueError, match="--quantize 'fp8' is not one of int8, int4"):
        parse_schemes("int8,fp8", 128)
