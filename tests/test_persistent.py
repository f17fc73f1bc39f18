"""The persistent layers kernel (``--layers_kernel triton``): which models and options it takes, that the model calls
it in compiled one-token steps of one sequence only, that it compiles for a GPU, and that in Triton's interpreter
(a launch per phase and layer) it computes what the model's layers compute (``persistent_reference.py``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt_fast.accel import persistent
from gpt_fast.accel.choice import Context
from gpt_fast.accel.options import KernelOptions
from gpt_fast.accel.persistent import check_layers_kernel, resolve_layers_kernel, use_layers_kernel
from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.model.config import QuantConfig
from gpt_fast.model.shapes import get_shape
from tests.interpreter import interpret, needs_triton

REFERENCE = Path(__file__).with_name("persistent_reference.py")
H200_PROGRAMS = 132


def test_kernel_choice_on_the_cpu():
    """``auto`` never takes the Triton kernel (on a CPU it takes the C++ one where that computes the model:
    ``tests/test_cpu_layers.py``)."""
    cpu = Context(torch.device("cpu"), "default", get_shape("tiny"), dtype=torch.bfloat16)
    assert resolve_layers_kernel("auto", cpu) == "torch"
    with pytest.raises(ValueError, match="triton layers kernel needs a CUDA GPU with Triton installed, not cpu"):
        resolve_layers_kernel("triton", cpu)
    with pytest.raises(ValueError, match="kernels.layers 'mega' is not one of auto, triton, cpp, torch"):
        EngineOptions(kernels=KernelOptions(layers="mega"))
    own_cache = Context(
        torch.device("cuda"), "default", get_shape("tiny"), dtype=torch.bfloat16, kv_dtype=torch.float16
    )
    with pytest.raises(
        ValueError, match="--layers_kernel triton reads a KV cache in the model's dtype, not torch.float16"
    ):
        resolve_layers_kernel("triton", own_cache)
    with pytest.raises(ValueError, match="the triton layers kernel needs a CUDA GPU"):
        Engine.from_state(get_shape("tiny"), {}, EngineOptions(device="cpu", kernels=KernelOptions(layers="triton")))


@pytest.mark.parametrize(
    "other, message",
    [
        ({"tp": 2}, "runs plain decoding on one GPU"),
        ({"compile": "reduce-overhead", "aot_precompile": True}, "aot_precompile does not combine with kernels.layers"),
        ({"batch_invariant": True}, "batch_invariant does not combine with kernels.layers triton"),
    ],
)
def test_options_it_does_not_combine_with(other, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions(**other, kernels=KernelOptions(layers="triton"))


def test_which_models_it_computes():
    """The default model's shape fits an H200's 132 programs; a 7B's layers do not (the kernel is for small models);
    family features it does not compute are refused by name."""
    check_layers_kernel(get_shape("smollm2-135m"), None, H200_PROGRAMS)
    with pytest.raises(ValueError, match="is for small models: this one gives each of 132 programs"):
        check_layers_kernel(get_shape("llama-2-7b"), None, H200_PROGRAMS)
    tiny = get_shape("tiny")
    with pytest.raises(ValueError, match="does not compute models with quantized weights"):
        check_layers_kernel(tiny, QuantConfig("int8"), H200_PROGRAMS)
    for fields, what in [
        ({"qkv_bias": True}, "q/k/v biases"),
        ({"mlp_activation": "gelu_tanh"}, "a GeGLU MLP"),
        ({"head_dim": 24}, "a head size that is not a power of two"),
        ({"sliding_window": 8, "layer_types": ("sliding_attention", "full_attention")}, "sliding-window layers"),
    ]:
        with pytest.raises(ValueError, match=f"does not compute models with {what}"):
            check_layers_kernel(dataclasses.replace(tiny, **fields), None, H200_PROGRAMS)


@torch.no_grad()
def test_compiled_one_token_steps_of_one_sequence_call_the_kernel_and_nothing_else_does():
    """The kernel replaces the layers in compiled steps of one token of a one-row cache only: eager steps, prefills
    and batches keep the layers' code. A stand-in that records its calls and runs the layers leaves the logits as
    they were."""
    shape = get_shape("tiny")
    options = EngineOptions(device="cpu", kernels=KernelOptions(layers="torch"))
    engine = Engine.from_state(shape, random_weights(shape, torch.float32, seed=0), options)
    model, calls = engine.model, []

    def stand_in(model, x, input_pos, first_row):
        calls.append((tuple(x.shape), tuple(input_pos.shape), first_row))
        cos, sin = model.rope_cos[input_pos], model.rope_sin[input_pos]
        mask = torch.where(torch.arange(model.max_seq_length) <= input_pos[..., None], 0.0, float("-inf"))
        for layer in model.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return x

    tokens = torch.randint(0, shape.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    model.setup_caches(1, 16)
    expected = [model(tokens[:1, :5], torch.arange(5)), model(tokens[:1, 5:], torch.tensor([5]))]
    model.layers_kernel = stand_in
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    got = [compiled(tokens[:1, :5], torch.arange(5)), model(tokens[:1, 5:], torch.tensor([5]))]
    assert calls == []  # a compiled prefill, then an eager step
    got.append(compiled(tokens[:1, 5:], torch.tensor([5])))
    assert calls == [((1, 1, shape.dim), (1,), 0)]
    for result in got[1:]:
        torch.testing.assert_close(result, expected[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    model.setup_caches(2, 16)  # two sequences: the layers' code
    compiled(tokens[:, 5:], torch.tensor([5]))
    assert len(calls) == 1
    use_layers_kernel(model, "torch")
    assert model.layers_kernel is None


def test_the_pointer_table_follows_the_caches():
    """Written when the kernel is chosen and whenever the caches are allocated anew, outside compiled code: a CUDA
    graph's capture cannot copy it from the host, and the graphs read it where it is."""
    shape = get_shape("tiny")
    engine = Engine.from_state(shape, random_weights(shape, torch.float32, seed=0), EngineOptions(device="cpu"))
    model = engine.model
    model.setup_caches(1, 16)
    use_layers_kernel(model, "triton")
    weights = persistent.layer_weights(model)
    kv = [layer.attention.kv_cache.kv for layer in model.layers]
    assert model.layers_table[1].tolist() == [t.data_ptr() for t in (*weights[6:12], kv[1])]
    table = model.layers_table.data_ptr()
    model.setup_caches(1, 32)
    assert model.layers_table.data_ptr() == table  # the same buffer, new contents
    assert model.layers_table[:, 6].tolist() == [layer.attention.kv_cache.kv.data_ptr() for layer in model.layers]
    use_layers_kernel(model, "torch")
    assert model.caches_ready is None and model.layers_kernel is None


@needs_triton
def test_the_kernel_compiles_for_a_gpu():
    """Triton's front end and ptxas accept the kernel with the default model's tiles for an H200, without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpt_fast.kernels import triton_persistent

    shape = get_shape("smollm2-135m")
    dims = (shape.n_head, shape.n_local_heads, shape.head_dim, shape.intermediate_size)
    launch = triton_persistent.layers_launch(dims, shape.dim, H200_PROGRAMS)
    constants = {
        "N_HEAD": shape.n_head,
        "N_KV": shape.n_local_heads,
        "HEAD_DIM": shape.head_dim,
        "PHASE": -1,
        "ROWS_QKV": launch.rows_qkv,
        "ROWS_O": launch.rows_o,
        "ROWS_MLP": launch.rows_mlp,
        "ROWS_DOWN": launch.rows_down,
        "BLOCK_D": launch.block_d,
        "BLOCK_Q": launch.block_q,
        "BLOCK_I": launch.block_i,
        "BLOCK_S": triton_persistent.BLOCK_S,
        "SPLITS": H200_PROGRAMS // shape.n_head,
    }
    kernel = triton_persistent._decode_layers
    signature = {name: "constexpr" if name in constants else "i32" for name in kernel.arg_names}
    signature.update({name: "*bf16" for name in kernel.arg_names if name.endswith("_ptr")})
    signature.update({"table": "*i64", "pos_ptr": "*i64", "bar_ptr": "*i32", "part_ptr": "*fp32"})
    signature.update({"cos_ptr": "*fp32", "sin_ptr": "*fp32", "eps": "fp32", "scale": "fp32"})
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": triton_persistent.WARPS},
    )
    assert "atom.global.gpu.release.add" in compiled.asm["ptx"]  # the barrier's arrival


@needs_triton
@pytest.mark.skipif(
    tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4),
    reason="Triton 3.6's interpreter takes int() of 1-element arrays, an error since numpy 2.4",
)
def test_the_kernel_in_the_interpreter_computes_the_layers():
    """float32 to rounding; bfloat16 within about two ulps of the residual (the interpreter truncates where the GPU
    rounds)."""
    report = json.loads(interpret(str(REFERENCE)))
    assert report["float32"] < 1e-5 and report["bfloat16"] < 3e-2
