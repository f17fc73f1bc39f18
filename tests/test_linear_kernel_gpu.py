"""GPU checks of the decode step's unquantized linear kernel (CUDA with Triton; skipped elsewhere): the kernel
against a float64 product, alone and in a CUDA graph after another kernel (where it is launched with programmatic
dependent launch on GPUs of compute capability 9+), and a model decoding with it in every CUDA-graph mode giving
eager's greedy tokens.

    python -m pytest -q -m gpu tests/test_linear_kernel_gpu.py
"""

import pytest
import torch

from gpt_fast.accel.options import KernelOptions
from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.kernels.available import triton_usable
from gpt_fast.model.shapes import get_shape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not triton_usable(torch.device("cuda")), reason="needs CUDA and Triton"
    ),
]


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).norm() / exact.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("n", "k", "bias"), [(12288, 4096, False), (4096, 11008, True), (1000, 576, True)])
def test_the_kernel_matches_a_float64_product(dtype, n, k, bias):
    from gpt_fast.kernels.triton_linear import linear_gemv

    torch.manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert relative_error(linear_gemv(x, w, b), exact) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_a_chain_in_a_cuda_graph_matches_the_same_chain_without_one():
    """Each GEMV reads the output of the one before (through a scaling kernel in between): if a kernel ran ahead of
    its input under PDL, the graph's result would differ from the stream's."""
    from gpt_fast.kernels.triton_linear import linear_gemv

    torch.manual_seed(0)
    weights = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) / 45 for _ in range(16)]
    x0 = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        x = x0
        for w in weights:
            x = linear_gemv(x * 1.0009765625, w)
        return x

    expected = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_norm_and_the_residual_inside_the_kernels_match_the_models_layer(dtype):
    """A Llama-2-7B layer's shapes: wqkv of the attention norm's output, wo plus the residual, w13 and the
    activation of the MLP norm's output, each against the model's own operations on the float64 product."""
    from gpt_fast.kernels.triton_linear import gated_gemv, linear_gemv
    from gpt_fast.model.transformer import gated, rms_norm

    torch.manual_seed(0)
    x = torch.randn(1, 4096, device="cuda", dtype=dtype)
    residual = torch.randn(1, 4096, device="cuda", dtype=dtype)
    norm_weight = (1 + torch.randn(4096, device="cuda") / 10).to(dtype)
    wqkv, wo, w13 = (torch.randn(n, 4096, device="cuda", dtype=dtype) / 64 for n in (12288, 4096, 22016))
    normed = rms_norm(x, norm_weight, 1e-5, 0.0).double()
    gate_up = (normed @ w13.double().T).to(dtype)
    pairs = [
        (linear_gemv(x, wqkv, norm_weight=norm_weight, eps=1e-5), normed @ wqkv.double().T),
        (linear_gemv(x, wo, residual=residual), residual.double() + (x.double() @ wo.double().T).to(dtype).double()),
        (gated_gemv(x, w13, "silu", norm_weight, 1e-5), gated(gate_up[:, :11008], gate_up[:, 11008:], "silu")),
    ]
    for got, exact in pairs:
        assert relative_error(got, exact.double()) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.fixture(scope="module")
def tiny_state():
    return random_weights(get_shape("tiny"), torch.float32, seed=0, device=torch.device("cuda"))


def greedy(state: dict, mode: str, kernel: str, attention: str = "torch") -> list[int]:
    """float32: see tests/test_quant_gpu.py's ``greedy``."""
    torch._dynamo.reset()
    options = EngineOptions(
        compile=mode, device="cuda", dtype="float32", kernels=KernelOptions(attention=attention, linear=kernel)
    )
    engine = Engine.from_state(get_shape("tiny"), state, options)
    prompt = list(range(1, 20))
    engine.generate_ids(prompt, 24, SamplingConfig(temperature=0))  # warm-up: compiles, captures the graph
    return engine.generate_ids(prompt, 24, SamplingConfig(temperature=0), ignore_eos=True).tokens[0]


@pytest.mark.parametrize("attention", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_decoding_with_the_kernel_gives_eagers_greedy_tokens(tiny_state, mode, attention):
    """With the fused attention too, both launched with PDL on GPUs of compute capability 9+."""
    assert greedy(tiny_state, mode, "triton", attention) == greedy(tiny_state, "none", "torch")


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("hidden", "k"), [(11008, 4096), (1536, 576), (1000, 300)])
def test_the_gated_kernel_matches_w13_then_the_activation(activation, dtype, hidden, k):
    """Against the model's code (:func:`gpt_fast.model.transformer.gated`) on the float64 product rounded to
    ``dtype``."""
    from gpt_fast.kernels.triton_linear import gated_gemv
    from gpt_fast.model.transformer import gated

    torch.manual_seed(hidden + k)
    w = torch.randn(2 * hidden, k, device="cuda", dtype=dtype) / k**0.5
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    gate_up = (x.double() @ w.double().T).to(dtype)
    exact = gated(gate_up[:, :hidden], gate_up[:, hidden:], activation).double()
    assert relative_error(gated_gemv(x, w, activation), exact) < (1e-6 if dtype == torch.float32 else 1e-2)
