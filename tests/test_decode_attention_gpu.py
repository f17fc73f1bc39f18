"""GPU checks of the fused decode attention (CUDA; on ROCm the Triton kernel is not used and these are skipped): the
kernel against the model's PyTorch code at real model shapes, over the static cache and the paged one, and compiled
decoding with it giving eager's greedy tokens, one sequence or several at their own positions (continuous batching,
over the batcher's paged cache).

    python -m pytest -q -m gpu tests/test_decode_attention_gpu.py
"""

import pytest
import torch
from decode_attention_reference import (
    CASES,
    PAGED_CASES,
    kernel_errors,
    model_configs,
    model_errors,
    paged_kernel_errors,
)

from gpt_fast.accel.options import KernelOptions
from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.kernels.available import triton_usable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not triton_usable(torch.device("cuda")), reason="needs CUDA and Triton"
    ),
]
# as decode_attention_reference.CASES: (batch, cache rows, heads, kv heads, head_dim, cache length, positions,
# first row, window, softcap, launch)
MODEL_SHAPES = [
    (1, 1, 32, 32, 128, 256, [200], 0, None, None, None),  # Llama-2-7B, the benchmark's cache
    (1, 1, 32, 32, 128, 2048, [2040], 0, None, None, None),  # Llama-2-7B, a long cache
    (1, 1, 32, 8, 128, 4096, [4000], 0, None, None, None),  # Llama-3-8B
    (8, 8, 9, 3, 64, 512, [[60 * i] for i in range(8)], 0, None, None, None),  # SmolLM2, 8 slots
    (2, 2, 16, 8, 256, 8192, [[8000], [4100]], 0, 4096, 50.0, None),  # Gemma 2: sliding window, soft-capping
    (1, 1, 32, 32, 96, 4096, [3000], 0, 2047, None, None),  # Phi-3
]
EIGHT_ROWS = [[round(1000 * i / 7)] for i in range(8)]  # positions 0 to 1000
# as decode_attention_reference.PAGED_CASES: (batch, table rows, heads, kv heads, head_dim, max_seq_length, block
# size, positions, first row, window, softcap, launch, rows on the sink)
PAGED_MODEL_SHAPES = [
    (8, 8, 32, 32, 128, 1024, 16, EIGHT_ROWS, 0, None, None, None, []),  # Llama-2-7B, a server's 8 rows
    (8, 8, 32, 8, 128, 1024, 16, EIGHT_ROWS, 0, None, None, None, [0]),  # Llama-3-8B, the first row on the sink
    (8, 8, 32, 8, 128, 8192, 16, EIGHT_ROWS, 0, None, None, None, []),  # Llama-3-8B, a long table: capped splits
    (2, 2, 16, 8, 256, 8192, 16, [[8000], [4100]], 0, 4096, 50.0, None, []),  # Gemma 2: sliding window, soft-capping
]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_the_kernel_matches_the_pytorch_code(dtype, tolerance):
    from gpt_fast.kernels.triton_decode_attention import decode_attention

    out, cache = kernel_errors(decode_attention, dtype, "cuda", CASES + MODEL_SHAPES)
    assert out < tolerance
    assert cache <= 2**-7  # the new key rounded the same, up to an ulp where a fused multiply-add rounds once


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_the_kernel_over_a_paged_cache_matches_the_pytorch_code(dtype, tolerance):
    from gpt_fast.kernels.triton_decode_attention import decode_attention

    out, cache = paged_kernel_errors(decode_attention, dtype, "cuda", PAGED_CASES + PAGED_MODEL_SHAPES)
    assert out < tolerance
    assert cache <= 2**-7


@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
def test_the_kernel_over_a_float8_cache_matches_the_pytorch_code(paged):
    """A bfloat16 model's float8 cache (``--kv_cache_dtype float8_e4m3fn``): the new key and value rounded to it as
    torch rounds them (the GPU's conversion, where the interpreter's cannot be checked), the output within
    bfloat16's rounding of the model's code reading the same cache."""
    from gpt_fast.kernels.triton_decode_attention import decode_attention

    f8 = torch.float8_e4m3fn
    if paged:
        out, cache = paged_kernel_errors(decode_attention, torch.bfloat16, "cuda", PAGED_CASES + PAGED_MODEL_SHAPES, f8)
    else:
        out, cache = kernel_errors(decode_attention, torch.bfloat16, "cuda", CASES + MODEL_SHAPES, f8)
    assert out < 1e-2
    assert cache <= 2**-3  # a float8 step at most, where the rotated key's bfloat16 rounding differs by an ulp


@pytest.mark.parametrize("operator", ["fused_decode_attention", "fused_decode_attention_pdl"])
def test_the_registered_operators_in_the_models_decode_steps(operator):
    from gpt_fast.accel import decode_attention

    decode_attention.register_triton_ops()
    assert model_errors(getattr(decode_attention, operator), "cuda") < 1e-4
    assert model_errors(getattr(decode_attention, operator), "cuda", "float8_e4m3fn") < 1e-3


GREEDY = SamplingConfig(temperature=0)


@pytest.mark.parametrize(
    "name, kv_cache_dtype", [(name, "auto") for name in model_configs()] + [("tiny", "float8_e4m3fn")]
)
def test_compiled_decoding_with_the_kernel_gives_eagers_greedy_tokens(name, kv_cache_dtype):
    """In CUDA graphs (``reduce-overhead``; tests/test_gpu.py covers every mode on the tiny checkpoint), float32,
    weights scaled up so that the argmax is clear: one prompt, then three prompts of different lengths decoded
    together (each row at its own position, in the batcher's paged cache); a float8 cache too."""
    mode = "reduce-overhead"
    shape = model_configs()[name]
    state = {n: t * 10 if t.dim() > 1 else t for n, t in random_weights(shape, torch.float32, seed=0).items()}
    prompts = [list(range(1, 21)), list(range(5, 12)), list(range(30, 63))]
    tokens = {}
    for compile_mode, kernel in (("none", "torch"), (mode, "triton")):
        kernels = KernelOptions(attention=kernel)
        options = EngineOptions(
            compile=compile_mode, device="cuda", dtype="float32", kernels=kernels, kv_cache_dtype=kv_cache_dtype
        )
        engine = Engine.from_state(shape, state, options)
        assert engine.kernels.attention == kernel
        single = [engine.generate_ids(prompts[0], 24, GREEDY).tokens[0] for _ in range(2)]  # compile, then replay
        assert single[0] == single[1]
        tokens[compile_mode] = single[0], [c.ids for c in engine.generate_many_ids(prompts, 24, GREEDY)]
    assert tokens[mode] == tokens["none"]
