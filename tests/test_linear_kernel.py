"""The decode step's unquantized linear kernel (gpt_fast/accel/linear.py, triton_linear.py, triton_pdl.py): which
kernel ``auto`` picks, the layers it swaps, the Triton kernel in Triton's interpreter against a float64 product
and inside a compiled model, and its launch with programmatic dependent launch compiled for an H200."""

import dataclasses
import json

import pytest
import torch
from torch import nn

from gpt_fast.accel.linear import DecodeLinear, resolve_linear_kernel, use_linear_kernel
from gpt_fast.accel.options import KernelOptions
from gpt_fast.checkpoint.load import model_from_state
from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import EngineOptions
from gpt_fast.model.config import QuantConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import Transformer
from gpt_fast.quant.layers import QuantizedLinear
from gpt_fast.quant.layout import quantize_state
from tests.interpreter import interpret, interpret_all, needs_triton, old_numpy

TINY = dataclasses.replace(get_shape("tiny"), qkv_bias=True)  # a bias too


def test_auto_is_the_model_code_on_the_cpu_and_triton_is_refused_there():
    cpu = torch.device("cpu")
    assert resolve_linear_kernel("auto", cpu, "reduce-overhead") == "torch"
    assert resolve_linear_kernel("torch", cpu, "none") == "torch"
    with pytest.raises(ValueError, match="the triton linear kernel needs a CUDA GPU with Triton installed"):
        resolve_linear_kernel("triton", cpu, "reduce-overhead")
    with pytest.raises(ValueError, match="linear kernel 'cublas' is not one of auto, triton, torch"):
        resolve_linear_kernel("cublas", cpu, "none")


@needs_triton
@pytest.mark.parametrize(
    ("mode", "capability", "expected"),
    [
        ("reduce-overhead", 9, "triton"),
        ("max-autotune", 10, "triton"),
        ("default", 9, "torch"),  # no CUDA graphs: no PDL
        ("reduce-overhead", 8, "torch"),  # no PDL before compute capability 9
    ],
)
def test_auto_takes_the_kernel_where_it_was_measured_faster(pretend_gpu, mode, capability, expected):
    from gpt_fast.kernels import pdl as triton_pdl

    gpu = pretend_gpu(capability)
    assert triton_pdl.pdl_usable(gpu) == (capability >= 9)
    kernel = resolve_linear_kernel("auto", gpu, mode)
    assert kernel == expected


def test_the_engine_options_refuse_what_the_kernel_does_not_combine_with():
    with pytest.raises(ValueError, match="kernels.linear 'x' is not one of auto, triton, torch"):
        EngineOptions(kernels=KernelOptions(linear="x"))
    with pytest.raises(ValueError, match="batch_invariant does not combine with kernels.linear triton"):
        EngineOptions(compile="reduce-overhead", batch_invariant=True, kernels=KernelOptions(linear="triton"))
    EngineOptions(
        compile="reduce-overhead", aot_precompile=True, kernels=KernelOptions(linear="triton")
    )  # a package calls it


def test_the_decoder_layers_linears_are_swapped_sharing_their_parameters():
    torch.manual_seed(0)
    model = Transformer(TINY)
    before = model.state_dict()
    head = model.output
    use_linear_kernel(model, "triton")
    swapped = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    assert len(swapped) == 4 * TINY.n_layer  # wqkv, wo, w13, w2 of each layer
    assert model.output is head and type(head) is nn.Linear  # the head keeps cuBLAS
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[name].data_ptr() == before[name].data_ptr() for name in before)
    x = torch.randn(1, 1, TINY.dim)
    layer = model.layers[0].attention.wqkv
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("changes", "fused"),
    [
        ({}, True),
        ({"qk_norm": True}, True),  # q/k norms are inside the attention, between the products
        ({"post_norms": True}, False),  # Gemma 2 and 3
        ({"norm_offset": 1.0}, False),  # Gemma: the kernels' norm has no offset
        ({"n_experts": 4, "n_active_experts": 2}, False),  # no gated MLP
    ],
)
def test_a_layer_runs_one_row_through_the_fused_kernels_only_where_they_compute_it(changes, fused):
    from gpt_fast.accel.linear import FusedRow

    model = Transformer(dataclasses.replace(TINY, **changes))
    use_linear_kernel(model, "triton")
    assert all(block.row_kernels is (FusedRow if fused else None) for block in model.layers)


def test_a_row_parallel_product_keeps_the_layer_unfused():
    """With tensor parallelism ``wo`` and ``w2`` are summed over the ranks after the product: a residual added
    inside it would be summed too."""
    from gpt_fast.parallel.tensor_parallel import AllReduced

    model = Transformer(TINY)
    for block in model.layers:
        block.attention.wo = AllReduced(block.attention.wo, "group", first=True)
    use_linear_kernel(model, "triton")
    assert all(block.row_kernels is None for block in model.layers)


def quantized_model(config, scheme: QuantConfig, dtype: torch.dtype) -> Transformer:
    """A model of ``config`` on the CPU with random weights quantized by ``scheme``, its quantized layers given the
    ``triton`` kernel (their weights repacked as for a GPU; ``prepare`` does not look at the device)."""
    state = quantize_state(random_weights(config, torch.float32, seed=0), config, scheme, dtype)
    model = model_from_state(config, state, torch.device("cpu"), dtype, scheme, kernel="dequant")
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.prepare("triton")
    return model


@pytest.mark.parametrize(
    ("scheme", "dtype", "intermediate", "fused", "gated"),
    [
        (QuantConfig("int8"), torch.bfloat16, 128, True, True),
        (QuantConfig("int8"), torch.bfloat16, 160, False, True),  # w2's 160 inputs: no words (64 per block)
        (QuantConfig("int4", 32), torch.bfloat16, 128, True, True),
        (QuantConfig("int8"), torch.float32, 128, False, False),  # float32 weights are not repacked
    ],
)
def test_a_quantized_layer_runs_one_row_through_the_fused_kernels_where_its_products_do(
    scheme, dtype, intermediate, fused, gated
):
    """A layer is fused only where each of its four quantized products runs our kernel on its repacked weights:
    int8 needs a 16-bit model and inputs a multiple of 64 (w2 of a 160-wide MLP keeps its bytes, and its layer
    its norms and residual adds, while w13, of 64 inputs, still takes the activation inside), int4 a 16-bit
    model and inputs a multiple of 4."""
    from gpt_fast.accel.linear import FusedRow

    model = quantized_model(dataclasses.replace(get_shape("tiny"), intermediate_size=intermediate), scheme, dtype)
    use_linear_kernel(model, "triton")
    assert all(block.row_kernels is (FusedRow if fused else None) for block in model.layers)
    gated_kernel = FusedRow.gated if gated else None
    assert all(block.feed_forward.gated_kernel is gated_kernel for block in model.layers)


def test_the_torch_kernel_keeps_the_models_linears():
    model = Transformer(TINY)
    use_linear_kernel(model, "torch")
    assert not any(isinstance(m, DecodeLinear) for m in model.modules())


INTERPRETED = """
import json, torch
from gpt_fast.kernels.triton_linear import linear_gemv
worst = {}
for dtype in (torch.float32, torch.bfloat16):
    for n, k, bias in ((64, 256, False), (37, 200, True), (8, 3000, True), (5, 2048, False)):
        g = torch.Generator().manual_seed(n * k)
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(1, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        exact = x.double() @ w.double().T + (b.double() if bias else 0)
        got = linear_gemv(x, w, b)
        assert got.dtype == dtype and got.shape == (1, n)
        key = str(dtype)
        worst[key] = max(worst.get(key, 0.0), ((got.double() - exact).norm() / exact.norm()).item())
from gpt_fast.kernels.triton_linear import gated_gemv
from gpt_fast.model.transformer import gated
for dtype in (torch.float32, torch.bfloat16):
    for activation in ("silu", "gelu_tanh"):
        for hidden, k in ((64, 256), (37, 200), (5, 2048)):
            g = torch.Generator().manual_seed(hidden * k)
            w = (torch.randn(2 * hidden, k, generator=g) / k**0.5).to(dtype)
            x = torch.randn(1, k, generator=g).to(dtype)
            gate_up = (x.double() @ w.double().T).to(dtype)
            exact = gated(gate_up[:, :hidden], gate_up[:, hidden:], activation).double()
            got = gated_gemv(x, w, activation)
            assert got.dtype == dtype and got.shape == (1, hidden)
            key = f"gated {dtype}"
            worst[key] = max(worst.get(key, 0.0), ((got.double() - exact).norm() / exact.norm()).item())
from gpt_fast.model.transformer import rms_norm
for dtype in (torch.float32, torch.bfloat16):
    for n, k in ((64, 256), (37, 200), (8, 3000)):
        g = torch.Generator().manual_seed(n + k)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        x = torch.randn(1, k, generator=g).to(dtype)
        norm_weight = (1 + torch.randn(k, generator=g) / 10).to(dtype)
        residual = torch.randn(1, n, generator=g).to(dtype)
        normed = rms_norm(x, norm_weight, 1e-5, 0.0).double()
        w13 = (torch.randn(2 * n, k, generator=g) / k**0.5).to(dtype)
        gate_up = (normed @ w13.double().T).to(dtype)
        pairs = {
            "normed": (linear_gemv(x, w, norm_weight=norm_weight, eps=1e-5), normed @ w.double().T),
            "plus residual": (
                linear_gemv(x, w, residual=residual),
                residual.double() + (x.double() @ w.double().T).to(dtype).double(),
            ),
            "gated normed": (
                gated_gemv(x, w13, "silu", norm_weight, 1e-5),
                gated(gate_up[:, :n], gate_up[:, n:], "silu").double(),
            ),
        }
        for name, (got, exact) in pairs.items():
            key = f"{name} {dtype}"
            worst[key] = max(worst.get(key, 0.0), ((got.double() - exact).norm() / exact.norm()).item())
print(json.dumps(worst))
"""


@pytest.mark.slow
@needs_triton
@old_numpy
def test_the_kernel_in_the_interpreter_matches_a_float64_product():
    """Even and ragged tiles, one step of columns and several, with and without a bias: float32 to 1e-6, bfloat16
    to the rounding of its output (the interpreter has no PDL: the kernel's constant compiles it out). The gated
    kernel against the model's activation of the float64 product rounded as w13's output is: float32 to 1e-6,
    bfloat16 to 3e-2, about an ulp in each of its four roundings (gate, up, the activation, the product), which the
    interpreter makes by truncation where a GPU rounds to nearest (tests/test_linear_kernel_gpu.py: 1e-2). With a
    norm inside (against the model's rms_norm, then the float64 product) or a residual added (to the product rounded
    as the model's layer output is): float32 to 1e-6, bfloat16 to the truncations of the extra roundings."""
    worst = json.loads(interpret("-c", INTERPRETED, timeout=300))
    assert worst["torch.float32"] < 1e-6 and worst["torch.bfloat16"] < 5e-3, worst
    assert worst["gated torch.float32"] < 1e-6 and worst["gated torch.bfloat16"] < 3e-2, worst
    for name, bfloat16 in (("normed", 2e-2), ("plus residual", 1e-2), ("gated normed", 4e-2)):
        assert worst[f"{name} torch.float32"] < 1e-6 and worst[f"{name} torch.bfloat16"] < bfloat16, worst


COMPILED = """
import dataclasses
import json
import torch
from gpt_fast.accel.linear import register_triton_ops, use_linear_kernel
from gpt_fast.model.transformer import Transformer
from gpt_fast.model.shapes import get_shape
from tests.interpreter import gemv_calls
config = dataclasses.replace(get_shape("tiny"), qkv_bias=True)
torch.manual_seed(0)
model = Transformer(config)
model.setup_caches(1, 32)
x = torch.randint(0, config.vocab_size, (1, 1))
pos = torch.tensor([3])
with torch.no_grad():
    expected = model(x, pos)
    register_triton_ops()
    use_linear_kernel(model, "triton")
    calls = gemv_calls()
    got = torch.compile(model, backend="eager", fullgraph=True)(x, pos)
print(json.dumps({"calls": calls, "error": float((got - expected).abs().max())}))
"""


@pytest.mark.slow
@needs_triton
@old_numpy
def test_a_compiled_one_token_step_calls_the_kernel_and_matches_the_model():
    """The swapped model compiled (Dynamo, eager backend) on the CPU with the kernels in Triton's interpreter: the
    one-token step equals the model's own within float32 rounding. Each layer made four products: wqkv of the
    attention norm's output, wo plus the residual, w13 and the activation of the MLP norm's output, w2 plus the
    residual: no norm or residual add outside them."""
    outcome = json.loads(interpret("-c", COMPILED, timeout=300))
    layer = ["linear_gemv normed", "linear_gemv plus residual", "gated_gemv normed", "linear_gemv plus residual"]
    assert outcome["calls"] == layer * TINY.n_layer and outcome["error"] < 1e-5


QUANTIZED = """
import dataclasses
import json
import torch
from gpt_fast.model.config import QuantConfig
from gpt_fast.accel.linear import register_triton_ops, use_linear_kernel
from gpt_fast.kernels import triton_gemv
from gpt_fast.quant import products as quant_kernels
from gpt_fast.model.shapes import get_shape
from tests.test_linear_kernel import quantized_model
calls = []
for name in ("int8_gemv", "int4_gemv"):
    kernel = getattr(triton_gemv, name)

    def spy(*args, name=name, kernel=kernel, **kwargs):
        inside = kwargs.get("inside", triton_gemv.NOTHING_INSIDE)
        parts = (
            ("normed", inside.norm_weight is not None),
            ("plus residual", inside.residual is not None),
            ("gated", inside.activation is not None),
        )
        calls.append(" ".join([name] + [part for part, present in parts if present]))
        return kernel(*args, **kwargs)

    setattr(triton_gemv, name, spy)
config = dataclasses.replace(get_shape("tiny"), intermediate_size=128)
quant_kernels.register_triton_ops()
register_triton_ops()
outcome = {}
for scheme in SCHEMES:
    model = quantized_model(config, scheme, torch.float16)
    model.setup_caches(1, 32)
    x = torch.randint(0, config.vocab_size, (1, 1))
    pos = torch.tensor([3])
    with torch.no_grad():
        expected = model(x, pos)
        use_linear_kernel(model, "triton")
        calls.clear()
        got = torch.compile(model, backend="eager", fullgraph=True)(x, pos)
    outcome[scheme.mode] = {"calls": list(calls), "error": float((got.float() - expected.float()).abs().max())}
print(json.dumps(outcome))
"""


@pytest.mark.slow
@needs_triton
@old_numpy
def test_a_compiled_quantized_one_token_step_fuses_each_layer_and_matches_the_model():
    """As the test above for int8 and int4 (group 32) float16 models (tiny, an MLP of 128, so that every product
    has repacked words): each layer made four calls of its quantized kernel, with the attention norm inside, the
    residual added, the MLP norm and activation inside, the residual added; no norm, residual add or activation
    outside them. The logits (about 0.5 in magnitude) equal the eager step's, where each norm, add and activation
    is rounded to float16 on its own, within 2e-3 (measured: 2.4e-4 to 5e-4)."""
    schemes = ('(QuantConfig("int8"),)', '(QuantConfig("int4", 32),)')  # a process each
    outcome = {}
    for out in interpret_all([["-c", QUANTIZED.replace("SCHEMES", s)] for s in schemes], timeout=300):
        outcome |= json.loads(out)
    for mode in ("int8", "int4"):
        kernel = f"{mode}_gemv"
        layer = [f"{kernel} normed", f"{kernel} plus residual", f"{kernel} normed gated", f"{kernel} plus residual"]
        assert outcome[mode]["calls"] == layer * TINY.n_layer and outcome[mode]["error"] < 2e-3, outcome


@needs_triton
@pytest.mark.parametrize("name", ["_linear_gemv", "_gated_gemv"])
def test_the_kernel_compiles_for_an_h200_with_its_weights_loaded_before_the_wait(name):
    """With PDL the first step's weights are loaded before ``griddepcontrol.wait``, and dependents are released
    only after it (the rule of :mod:`gpt_fast.kernels.pdl`); with the norm inside and the residual added too."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpt_fast.kernels import triton_linear

    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "g_ptr": "*bf16", "y_ptr": "*bf16"}
    if name == "_linear_gemv":
        signature = pointers | {"b_ptr": "*bf16", "r_ptr": "*bf16", "N": "i32", "K": "i32", "eps": "fp32"}
        constants = {"HAS_BIAS": False, "RESIDUAL": True, "BLOCK_N": triton_linear.BLOCK_N}
    else:
        signature = pointers | {"hidden": "i32", "K": "i32", "eps": "fp32"}
        constants = {"GELU": False, "HALF_N": triton_linear.BLOCK_N // 2}
    constants |= {"NORM": True, "BLOCK_K": triton_linear.BLOCK_K, "ROW_K": 4096, "EVEN": True, "PDL": True}
    signature |= dict.fromkeys(constants, "constexpr")
    compiled = triton.compile(
        ASTSource(getattr(triton_linear, name), signature, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": triton_linear.WARPS, "launch_pdl": True},
    )
    lines = compiled.asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    release = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
    assert any("ld.global" in line for line in lines[:wait])  # weights before the wait
    assert release > wait
