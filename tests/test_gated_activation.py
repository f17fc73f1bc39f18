"""The choice of the gated MLP's activation kernel, its place in the model's compiled decode steps, and the Triton
kernel (compiled for a GPU, and run in Triton's interpreter) against the model's PyTorch code, where Triton is
installed."""

import dataclasses
import json

import numpy as np
import pytest
import torch

import gpt_fast.accel.gated_activation as gated_activation
import gpt_fast.quant.products as quant_kernels
from gpt_fast.accel.gated_activation import resolve_activation_kernel, use_activation_kernel
from gpt_fast.accel.options import KernelOptions
from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import FeedForward, gated
from tests.interpreter import interpret, needs_triton


def test_kernel_choice_on_the_cpu():
    cpu, shape = torch.device("cpu"), get_shape("llama-2-7b")
    assert resolve_activation_kernel("auto", cpu, shape) == "torch"
    assert resolve_activation_kernel("torch", cpu, shape) == "torch"
    with pytest.raises(ValueError, match="triton activation kernel needs a CUDA GPU with Triton installed, not cpu"):
        resolve_activation_kernel("triton", cpu, shape)
    with pytest.raises(ValueError, match="activation kernel 'fused' is not one of auto, triton, torch"):
        resolve_activation_kernel("fused", cpu, shape)


def test_auto_takes_the_kernel_for_large_mlps_on_a_gpu_with_triton(monkeypatch):
    """Where Triton runs, ``auto`` gives large MLPs the kernel (a 7B's) and small ones the PyTorch code (the default
    model's), as do ahead-of-time packages; on ROCm every model keeps the PyTorch code."""
    gpu = torch.device("cuda")
    registered = []
    monkeypatch.setattr(gated_activation, "register_triton_ops", lambda: registered.append(True))
    for module in (gated_activation, quant_kernels):
        monkeypatch.setattr(module, "triton_usable", lambda device: True)
    assert resolve_activation_kernel("auto", gpu, get_shape("llama-2-7b")) == "triton"
    assert resolve_activation_kernel("auto", gpu, get_shape("smollm2-135m")) == "torch"
    assert resolve_activation_kernel("triton", gpu, get_shape("smollm2-135m")) == "triton"
    assert len(registered) == 2
    for module in (gated_activation, quant_kernels):
        monkeypatch.setattr(module, "triton_usable", lambda device: False)
    assert resolve_activation_kernel("auto", gpu, get_shape("llama-2-7b")) == "torch"


def test_engine_options_check_the_activation_kernel():
    with pytest.raises(ValueError, match="kernels.activation 'fused' is not one of auto, triton, torch"):
        EngineOptions(kernels=KernelOptions(activation="fused"))
    with pytest.raises(ValueError, match="the triton activation kernel needs a CUDA GPU"):
        Engine.from_state(
            get_shape("tiny"), {}, EngineOptions(device="cpu", kernels=KernelOptions(activation="triton"))
        )


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@torch.no_grad()
def test_compiled_decode_steps_call_the_kernel_and_nothing_else_does(activation):
    """The kernel replaces ``gated`` in compiled steps of one position per row only: eager steps and prefills keep
    the PyTorch code. A stand-in kernel that records its calls and computes as ``gated`` leaves the logits as
    they were. The layers' code runs them (not the C++ layers, which compute a CPU's decode steps whole)."""
    shape = dataclasses.replace(get_shape("tiny"), mlp_activation=activation)
    options = EngineOptions(device="cpu", kernels=KernelOptions(layers="torch"))
    engine = Engine.from_state(shape, random_weights(shape, torch.float32, seed=0), options)
    model, calls = engine.model, []

    def stand_in(gate_up: torch.Tensor, name: str) -> torch.Tensor:
        calls.append((tuple(gate_up.shape), name))
        gate, up = gate_up.chunk(2, dim=-1)
        return gated(gate, up, name)

    model.setup_caches(2, 16)
    tokens = torch.randint(0, shape.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    expected = [model(tokens[:, :5], torch.arange(5)), model(tokens[:, 5:], torch.tensor([5]))]
    for module in model.modules():
        if isinstance(module, FeedForward):
            module.activation_kernel = stand_in
    model.setup_caches(2, 16)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    got = [compiled(tokens[:, :5], torch.arange(5)), model(tokens[:, 5:], torch.tensor([5]))]
    assert calls == []  # a compiled prefill, then an eager decode step
    got.append(compiled(tokens[:, 5:], torch.tensor([5])))
    hidden = 2 * shape.intermediate_size
    assert calls == [((2, 1, hidden), activation)] * shape.n_layer
    for result in got[1:]:
        torch.testing.assert_close(result, expected[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    use_activation_kernel(model, "torch")
    assert all(m.activation_kernel is None for m in model.modules() if isinstance(m, FeedForward))


@needs_triton
@pytest.mark.parametrize("gelu", [False, True])
def test_the_kernel_compiles_for_a_gpu(gelu):
    """Triton's front end and ptxas accept the kernel for an H100/H200 without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpt_fast.kernels.triton_gated_activation import BLOCK, _gated_activation

    signature = {"gate_up_ptr": "*bf16", "out_ptr": "*bf16", "hidden": "i32", "GELU": "constexpr", "BLOCK": "constexpr"}
    source = ASTSource(_gated_activation, signature, constexprs={"GELU": gelu, "BLOCK": BLOCK})
    assert "cubin" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm


INTERPRETED = """
import json, torch
from gpt_fast.kernels.triton_gated_activation import gated_activation
from gpt_fast.model.transformer import gated
worst = {}
for dtype in (torch.float32, torch.bfloat16):
    for activation in ("silu", "gelu_tanh"):
        for shape in ((1, 1, 2 * 1536), (3, 1, 2 * 2500), (2, 5, 2 * 96)):
            gate_up = (4 * torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))).to(dtype)
            if shape[1] > 1:  # not contiguous: the rows of another layout
                gate_up = gate_up.transpose(0, 1).contiguous().transpose(0, 1)
            got = gated_activation(gate_up, activation)
            exact = gate_up.double() if dtype == torch.float32 else gate_up  # bfloat16: PyTorch's own rounding
            expected = gated(*exact.chunk(2, dim=-1), activation)
            ulp = torch.finfo(dtype).eps * expected.float().abs().clamp(min=1.0)  # absolute below 1
            key = f"{dtype} {activation}"
            worst[key] = max(worst.get(key, 0.0), ((got.float() - expected.float()).abs() / ulp).max().item())
print(json.dumps(worst))
"""


@pytest.mark.slow
@needs_triton
@pytest.mark.skipif(
    tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4),
    reason="Triton 3.6's interpreter takes int() of 1-element arrays, an error since numpy 2.4",
)
def test_the_kernel_in_the_interpreter_matches_the_pytorch_code():
    """SiLU and tanh-GeLU, one row and several (in another layout too), ragged blocks, within two ulps (relative
    above 1, absolute below): in float32 of the PyTorch code in float64 (PyTorch's float32 tanh-GeLU cancels in
    1 + tanh for x < 0), in bfloat16 of the PyTorch code in bfloat16 (the interpreter rounds float32 to bfloat16 by
    truncation, the GPU to nearest)."""
    worst = json.loads(interpret("-c", INTERPRETED, timeout=300))
    assert all(error <= 2.0 for error in worst.values()), worst
