"""GPU checks of the top-k sampling kernels (CUDA with Triton; skipped elsewhere): the kernels against the PyTorch
reference of their semantics (tests/top_k_reference.py), launched from Python and replayed in a CUDA graph after
another kernel (where they are launched with programmatic dependent launch on GPUs of compute capability 9+), and a
model decoding with them in every CUDA-graph mode: top-1 sampling gives greedy decoding's tokens.

    python -m pytest -q -m gpu tests/test_top_k_kernel_gpu.py
"""

import pytest
import torch

from gpt_fast.accel.options import KernelOptions
from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.kernels.available import triton_usable
from gpt_fast.model.shapes import get_shape
from tests.top_k_reference import mismatches, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not triton_usable(torch.device("cuda")), reason="needs CUDA and Triton"
    ),
]


def test_the_kernels_draw_the_references_tokens():
    assert mismatches("cuda") == []


@pytest.mark.parametrize("vocab", [32000, 49152, 128256])
def test_the_operator_replayed_in_a_cuda_graph_draws_the_references_tokens(vocab):
    from gpt_fast.accel.top_k import register_triton_ops, triton_top_k

    register_triton_ops()
    torch.manual_seed(vocab)
    logits = (torch.randn(2, vocab, device="cuda") * 3).bfloat16()
    scaled = torch.empty_like(logits)
    noise = torch.empty(2, vocab, device="cuda")

    def step() -> torch.Tensor:
        torch.mul(logits, 1.0, out=scaled)  # a kernel before, as in a decode step
        return triton_top_k(scaled, noise, 200, 0.8)

    noise.exponential_()
    step()  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = step()
    for _ in range(3):
        noise.exponential_()
        graph.replay()
        assert tokens.tolist() == reference(logits, noise, 200, 0.8)


@pytest.fixture(scope="module")
def tiny_state():
    return random_weights(get_shape("tiny"), torch.bfloat16, seed=0, device=torch.device("cuda"))


@pytest.mark.parametrize("mode", ["none", "reduce-overhead", "max-autotune"])
def test_top_1_sampling_through_the_kernels_gives_greedy_tokens(tiny_state, mode):
    """bfloat16 logits (the kernels' input); the same engine decodes greedily (the argmax, no kernel) and samples
    the top 1 through the kernels."""
    torch._dynamo.reset()
    options = EngineOptions(compile=mode, device="cuda", dtype="bfloat16", kernels=KernelOptions(sampling="triton"))
    engine = Engine.from_state(get_shape("tiny"), tiny_state, options)
    prompt = list(range(1, 20))
    runs = {}
    for name, sampling in (("greedy", SamplingConfig(temperature=0)), ("top-1", SamplingConfig(0.8, top_k=1))):
        engine.generate_ids(prompt, 24, sampling)  # warm-up: compiles, captures the graph
        runs[name] = engine.generate_ids(prompt, 24, sampling, ignore_eos=True).tokens[0]
    assert runs["top-1"] == runs["greedy"]
    assert engine.model.top_k_sampler is not None
