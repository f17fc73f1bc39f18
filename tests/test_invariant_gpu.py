"""GPU checks of batch-invariant steps (CUDA with Triton; elsewhere the CPU tests cover the reference operators): the
Triton kernels against the reference operators, each row of a many-row launch equal to the row launched alone; and
speculative decoding in bfloat16 on random weights of real model shapes (crowded logits, where a verify step with the
usual kernels leaves plain decoding within a few tokens: docs/bench/HISTORY.md, 2026-11-22c) giving plain decoding's
tokens, eager and in CUDA graphs.

    python -m pytest -q -m gpu tests/test_invariant_gpu.py
"""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.drafters import PromptLookup, Replay
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.kernels.available import triton_usable
from gpt_fast.model.shapes import get_shape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not triton_usable(torch.device("cuda")), reason="needs CUDA and Triton"
    ),
]
GREEDY = SamplingConfig(temperature=0)
PROMPT = [7, 8, 9, 10, 11, 12] * 4


def test_the_triton_kernels_match_the_reference_and_keep_rows_apart():
    spec = importlib.util.spec_from_file_location(
        "invariant_reference", Path(__file__).with_name("invariant_reference.py")
    )
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    report = reference.report("cuda")
    assert report["rows_alike"] is True
    assert report["float32"] < 1e-5 and report["bfloat16"] < 1e-2


@pytest.mark.parametrize("compile", ["none", "reduce-overhead"])
@pytest.mark.parametrize("shape", ["smollm2-135m", "qwen2.5-7b"])
def test_speculation_gives_plain_decoding_s_tokens_in_bfloat16(shape, compile):
    """Two layers of each shape (the per-layer code is what matters), random N(0, 0.02²) weights. A request for more
    tokens (a longer KV cache) starts with the same tokens. Plain decoding is recorded past the replay's end: the
    host may start two rounds beyond the last one it needs, and their proposals count in the acceptance rate."""
    config = dataclasses.replace(get_shape(shape), n_layer=2)
    options = EngineOptions(compile=compile, device="cuda", dtype="bfloat16", batch_invariant=True)
    engine = Engine.from_state(config, random_weights(config, torch.bfloat16, seed=0), options)
    plain = engine.generate_ids(PROMPT, 72, GREEDY, ignore_eos=True).tokens[0]
    longer = engine.generate_ids(PROMPT, 200, GREEDY, ignore_eos=True).tokens[0]  # a longer KV cache
    assert longer[:72] == plain
    lookup = engine.generate_ids(PROMPT, 48, GREEDY, ignore_eos=True, drafter=PromptLookup(2, 4))
    assert lookup.tokens[0] == plain[:48]
    replay = engine.generate_ids(PROMPT, 40, GREEDY, ignore_eos=True, drafter=Replay(PROMPT + plain, 8))
    assert replay.tokens[0] == plain[:40] and replay.speculative.acceptance_rate == 1.0
