"""The decode steps' top-k sampling kernel (gpt_fast/accel/top_k.py, triton_top_k.py): which kernel is chosen and
refused, when :func:`gpt_fast.generation.sampling.sample` hands the logits to it, and the kernels in Triton's
interpreter against the PyTorch reference of their semantics (tests/top_k_reference.py)."""

import json
from pathlib import Path

import pytest
import torch

from gpt_fast.accel.options import KernelOptions
from gpt_fast.accel.top_k import resolve_sampling_kernel
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.sampling import SamplingConfig, sample
from gpt_fast.model.shapes import get_shape
from tests.interpreter import interpret, needs_triton, old_numpy
from tests.top_k_reference import reference


def test_triton_needs_a_cuda_gpu():
    cpu = torch.device("cpu")
    assert resolve_sampling_kernel("auto", cpu, "reduce-overhead") == "torch"
    assert resolve_sampling_kernel("torch", cpu, "none") == "torch"
    with pytest.raises(ValueError, match="the triton sampling kernel needs a CUDA GPU with Triton installed"):
        resolve_sampling_kernel("triton", cpu, "none")


@needs_triton
@pytest.mark.parametrize(
    ("mode", "capability", "expected"),
    [
        ("reduce-overhead", 9, "triton"),  # CUDA graphs and PDL: where our GEMV is taken
        ("max-autotune", 9, "triton"),
        ("default", 9, "torch"),  # launched from Python: not measured
        ("reduce-overhead", 8, "torch"),  # no PDL before compute capability 9
    ],
)
def test_auto_takes_the_kernel_where_our_gemv_is_taken(monkeypatch, pretend_gpu, mode, capability, expected):
    from gpt_fast.accel import top_k

    gpu = pretend_gpu(capability)
    monkeypatch.setattr(top_k, "register_triton_ops", lambda: None)
    assert resolve_sampling_kernel("auto", gpu, mode) == expected


def test_the_engine_options_check_the_sampling_kernel():
    with pytest.raises(ValueError, match="kernels.sampling 'radix' is not one of auto, triton, torch"):
        EngineOptions(kernels=KernelOptions(sampling="radix"))
    EngineOptions(
        compile="reduce-overhead", aot_precompile=True, kernels=KernelOptions(sampling="triton")
    )  # a package calls it
    with pytest.raises(ValueError, match="the triton sampling kernel needs a CUDA GPU"):
        Engine.from_state(get_shape("tiny"), {}, EngineOptions(device="cpu", kernels=KernelOptions(sampling="triton")))


class ReferenceSampler:
    """A top-k sampler computing the reference's tokens, recording its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []

    def __call__(self, logits: torch.Tensor, noise: torch.Tensor, top_k: int, temperature: float) -> torch.Tensor:
        assert noise.shape == logits.shape and noise.dtype == torch.float32 and bool((noise > 0).all())
        self.calls.append((top_k, temperature))
        return torch.tensor(reference(logits, noise, top_k, temperature))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sample_hands_16_bit_top_k_logits_to_the_sampler(dtype):
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0)).to(dtype)
    sampler = ReferenceSampler()
    tokens = sample(logits, SamplingConfig(temperature=0.7, top_k=20), sampler)
    assert sampler.calls == [(20, 0.7)] and tokens.shape == (3,)
    kth = torch.topk(logits.float(), 20).values[:, -1]  # [3]
    assert bool((logits.float().gather(1, tokens[:, None]).squeeze(1) >= kth).all())


@pytest.mark.parametrize(
    ("dtype", "config"),
    [
        (torch.float32, SamplingConfig(0.7, top_k=20)),  # 32-bit logits
        (torch.bfloat16, SamplingConfig(0.7, top_k=20, top_p=0.9)),  # top-p
        (torch.bfloat16, SamplingConfig(0.7, top_k=None)),  # the whole vocabulary
        (torch.bfloat16, SamplingConfig(0.7, top_k=500)),  # k = V
        (torch.bfloat16, SamplingConfig(temperature=0)),  # greedy
    ],
)
def test_sample_keeps_the_pytorch_code_for_what_the_kernels_do_not_take(dtype, config):
    sampler = ReferenceSampler()
    tokens = sample(torch.randn(2, 500).to(dtype), config, sampler)
    assert sampler.calls == [] and tokens.shape == (2,)


@needs_triton
@old_numpy
def test_the_kernels_in_the_interpreter_draw_the_references_tokens():
    """Every case of tests/top_k_reference.py, ties at the k-th largest among them (their lowest ids taken, counted
    across programs' chunks), bfloat16 and float16, several rows."""
    assert json.loads(interpret(str(Path(__file__).with_name("top_k_reference.py")), timeout=300)) == []
