"""The peer benchmark's CPU path on a tiny shape: ours and transformers on identical weights."""

import torch

from gpt_fast.bench_decode import hf_runners, run_benchmark
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


def test_table_on_the_cpu(capsys):
    lines = []
    rows = run_benchmark(
        "tiny",
        torch.device("cpu"),
        mode="none",
        dtype=torch.float32,
        prompt_tokens=5,
        new_tokens=8,
        ttft_tokens=16,
        repeats=2,
        peers=True,
        write=lines.append,
    )
    assert [r.name.split()[0] for r in rows] == ["gpt-fast", "transformers", "transformers"]
    assert all(r.tokens_per_sec > 0 and r.ttft_ms > 0 and r.compile_seconds > 0 for r in rows)
    table = lines[-1].splitlines()
    assert table[0].startswith("| implementation | compile (s) | tok/s | GB/s | % of copy BW | TTFT (ms)")
    assert len(table) == 2 + len(rows)


def test_hf_runner_generates_exactly_the_requested_tokens():
    shape = get_shape("tiny")
    run, _ = hf_runners(random_weights(shape, torch.float32, seed=1), shape, False, torch.device("cpu"), torch.float32)
    run([1, 2, 3], 4)
