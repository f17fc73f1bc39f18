"""GPU checks of the gated MLP's activation kernel (CUDA; on ROCm it is not used and these are skipped): the kernel
against the PyTorch code at real model widths, and compiled decoding with it giving eager's greedy tokens, in CUDA
graphs and from an ahead-of-time package.

    python -m pytest -q -m gpu tests/test_gated_activation_gpu.py
"""

import pytest
import torch

from gpt_fast.accel.options import KernelOptions
from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.precompile import LOADED
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.kernels.available import triton_usable
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import gated

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not triton_usable(torch.device("cuda")), reason="needs CUDA and Triton"
    ),
]
GREEDY = SamplingConfig(temperature=0)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("hidden", [1536, 11008, 14336])  # SmolLM2, Llama-2-7B, Llama-3-8B / Gemma-2-9B
@pytest.mark.parametrize("rows", [1, 8])
def test_the_kernel_matches_the_pytorch_code(activation, hidden, rows):
    """bfloat16: PyTorch's own rounding points, within two ulps (the activation's float32 value may differ in its
    last bits and round the other way); float32: within eight ulps of the PyTorch code in float64 (Triton's exp is
    the GPU's approximate one)."""
    from gpt_fast.kernels.triton_gated_activation import gated_activation

    generator = torch.Generator(device="cuda").manual_seed(hidden + rows)
    base = 4 * torch.randn(rows, 1, 2 * hidden, device="cuda", generator=generator)
    for dtype, exact_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float64)):
        gate_up = base.to(dtype)
        expected = gated(*gate_up.to(exact_dtype).chunk(2, dim=-1), activation).double()
        error = (gated_activation(gate_up, activation).double() - expected).abs() / expected.abs().clamp(min=1.0)
        worst = error.max().item() / torch.finfo(dtype).eps
        assert worst <= (2 if dtype == torch.bfloat16 else 8), (dtype, worst)


@pytest.mark.parametrize("aot_precompile", [False, True], ids=["torch.compile", "aot_precompile"])
def test_compiled_decoding_with_the_kernel_gives_eagers_greedy_tokens(aot_precompile, tmp_path, monkeypatch):
    """float32, weights scaled up so that the argmax is clear; CUDA graphs (``reduce-overhead``): one prompt, and
    (without the package, which keeps one prompt's step) three prompts decoded together."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    shape = get_shape("tiny")
    state = {n: t * 10 if t.dim() > 1 else t for n, t in random_weights(shape, torch.float32, seed=0).items()}
    prompts = [list(range(1, 21)), list(range(5, 12)), list(range(30, 63))]
    tokens = {}
    for mode, kernel in (("none", "torch"), ("reduce-overhead", "triton")):
        precompiled = aot_precompile and mode != "none"
        options = EngineOptions(
            compile=mode,
            device="cuda",
            dtype="float32",
            aot_precompile=precompiled,
            kernels=KernelOptions(activation=kernel),
        )
        engine = Engine.from_state(shape, state, options)
        assert engine.kernels.activation == kernel
        single = [engine.generate_ids(prompts[0], 24, GREEDY).tokens[0] for _ in range(2)]  # compile, then replay
        assert single[0] == single[1]
        many = [] if aot_precompile else [c.ids for c in engine.generate_many_ids(prompts, 24, GREEDY)]
        tokens[mode] = single[0], many
    assert tokens["reduce-overhead"] == tokens["none"]
    if aot_precompile:  # a new engine loads the package saved above, kernel and all
        options = EngineOptions(
            compile="reduce-overhead",
            device="cuda",
            dtype="float32",
            aot_precompile=True,
            kernels=KernelOptions(activation="triton"),
        )
        engine = Engine.from_state(shape, state, options)
        assert engine.generate_ids(prompts[0], 24, GREEDY).tokens[0] == tokens["none"][0]
        assert engine.aot_package.startswith(LOADED), engine.aot_package
