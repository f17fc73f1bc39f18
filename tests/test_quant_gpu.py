"""GPU checks of the quantized layers (CUDA; on ROCm the Triton kernels are not used and these are skipped): the
Triton kernels against a float64 product, and quantized weights in every compile mode giving eager's greedy
tokens.

    python -m pytest -q -m gpu tests/test_quant_gpu.py
"""

import functools
import importlib.util

import pytest
import torch

from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.decode import COMPILE_MODES
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.kernels.available import triton_usable
from gpt_fast.model.config import QuantConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.quant.layout import quantize_state
from gpt_fast.quant.products import INT8_BLOCK, group_interleave, int8_interleave, resolve_kernel
from gpt_fast.quant.schemes import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not triton_usable(torch.device("cuda")), reason="needs CUDA and Triton"
    ),
]
SCHEMES = [QuantConfig("int8"), QuantConfig("int4", 128), QuantConfig("int4", 32, output=True)]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected|| / ||expected||, in float64."""
    expected = expected.double()
    return ((got.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n, k", [(4096, 4096), (1000, 576), (96, 200)])
def test_triton_kernels_match_a_float64_product(dtype, rows, n, k):
    from gpt_fast.kernels import triton_gemv

    torch.manual_seed(n + k + rows)
    weight = torch.randn(n, k, device="cuda")
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    q, s = quantize_int8(weight, dtype)
    expected = x.double() @ dequantize_int8(q, s).double().T
    for matrix in [q, int8_interleave(q)] if k % INT8_BLOCK == 0 and dtype != torch.float32 else [q]:
        got = triton_gemv.int8_gemv(x, matrix, s).double()
        assert relative_error(got, expected) < 1e-2
    q, s, z = quantize_int4(weight, 64, dtype)
    expected = x.double() @ dequantize_int4(q, s, z, 64).double().T
    for launch in [None, triton_gemv.Launch(8, 8 * 64, 1, half2=True), triton_gemv.Launch(1, 2 * 64, 2, half2=True)]:
        got = triton_gemv.int4_gemv(x, group_interleave(q, 64), s, z, 64, launch).double()
        assert relative_error(got, expected) < 1e-2
    for group in (32, 256):
        q, s, z = quantize_int4(weight, group, dtype)
        expected = x.double() @ dequantize_int4(q, s, z, group).double().T
        got = triton_gemv.int4_gemv(x, group_interleave(q, group), s, z, group).double()
        assert relative_error(got, expected) < 1e-2


@pytest.mark.parametrize("size", [1e-3, 1.0, 3e4])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_float16_pairs_hold_small_and_large_activations(scheme, size):
    """The float16-pairs paths sum products in float16 (int4: two words' sixteen; interleaved int8: eight, four per
    half): activations of every size up to half float16's largest (32752), all of one magnitude at the top, must
    not overflow their partial sums nor lose precision when small, against a float64 product and the float32
    path (int8: the matrix as it is)."""
    from gpt_fast.kernels import triton_gemv

    torch.manual_seed(7)
    weight = torch.randn(512, 4096, device="cuda")
    x = torch.randn(1, 4096, device="cuda")
    x = ((x.sign() if size > 1e4 else x) * size).bfloat16()
    if scheme == "int8":
        q, s = quantize_int8(weight, torch.bfloat16)
        expected = x.double() @ dequantize_int8(q, s).double().T
        products = [triton_gemv.int8_gemv(x, int8_interleave(q), s), triton_gemv.int8_gemv(x, q, s)]
    else:
        q, s, z = quantize_int4(weight, 128, torch.bfloat16)
        words = group_interleave(q, 128)
        expected = x.double() @ dequantize_int4(q, s, z, 128).double().T
        launches = [triton_gemv.Launch(8, 1024, 1, half2=True), triton_gemv.Launch(8, 1024, 1)]
        products = [triton_gemv.int4_gemv(x, words, s, z, 128, launch) for launch in launches]
    errors = [relative_error(got, expected) for got in products]
    packed, plain = errors
    assert packed < 2 * plain + 1e-3


@pytest.mark.parametrize("pdl", [False, True], ids=["triton_op", "pdl"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("n", [4096, 22016])
def test_operators_compile_into_a_cuda_graph_step(n, scheme, pdl):
    """The operators for bf16 activations (the float16-pairs kernels, whose PTX inductor copies into the code it
    generates; ``pdl``: the opaque operators launched with PDL, reading what a kernel of inductor's just wrote)
    give, compiled in a CUDA-graph mode, what they give called directly (within rounding: inductor's sigmoid is its
    own)."""
    from gpt_fast.quant.products import int4_triton_linear, int8_linear, register_triton_ops

    register_triton_ops()
    torch._dynamo.reset()
    torch.manual_seed(n)
    weight = torch.randn(n, 4096, device="cuda")
    if scheme == "int8":
        q, s = quantize_int8(weight, torch.bfloat16)
        product = functools.partial(int8_linear, weight=int8_interleave(q), scales=s, kernel="triton", pdl=pdl)
    else:
        q, s, z = quantize_int4(weight, 128, torch.bfloat16)
        words = group_interleave(q, 128)
        product = functools.partial(int4_triton_linear, words=words, scales=s, zeros=z, group_size=128, pdl=pdl)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    step = torch.compile(lambda rows: product(torch.sigmoid(rows)) * 2, mode="reduce-overhead")
    for _ in range(3):  # warm-up, recording, replay
        got = step(x).clone()
    expected = product(torch.sigmoid(x)) * 2
    assert relative_error(got, expected) < 1e-2


@pytest.mark.parametrize("rows", [8, 33])
def test_the_rows_product_compiles_into_a_cuda_graph_step(rows):
    """The operator of a batched step's int4 rows (:func:`gpt_fast.kernels.triton_matmul.int4_rows`, whose PTX
    inductor copies into the code it generates) gives, compiled in a CUDA-graph mode, what it gives called directly
    (within rounding: inductor's sigmoid is its own)."""
    from gpt_fast.quant.products import register_triton_ops

    register_triton_ops()
    torch._dynamo.reset()
    torch.manual_seed(rows)
    q, s, z = quantize_int4(torch.randn(4096, 4096, device="cuda"), 128, torch.bfloat16)
    words = group_interleave(q, 128)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    step = torch.compile(
        lambda r: torch.ops.gpt_fast.int4_rows(torch.sigmoid(r), words, s, z, 128) * 2, mode="reduce-overhead"
    )
    for _ in range(3):  # warm-up, recording, replay
        got = step(x).clone()
    assert relative_error(got, torch.ops.gpt_fast.int4_rows(torch.sigmoid(x), words, s, z, 128) * 2) < 1e-2


def greedy(state, quant, mode):
    """float32: in bf16 the tiny random model's top two logits come within rounding of each other, and eager (SDPA,
    our kernel called directly) and compiled steps (inductor's fusions around it) then pick different tokens."""
    torch._dynamo.reset()  # nine engines' steps in one process would pass Dynamo's limit of recompilations
    shape = get_shape("tiny")
    engine = Engine.from_state(shape, state, EngineOptions(compile=mode, device="cuda", dtype="float32"), quant)
    prompt = list(range(1, 20))
    engine.generate_ids(prompt, 24, SamplingConfig(temperature=0))  # warm-up: compiles, captures the graph
    return engine.generate_ids(prompt, 24, SamplingConfig(temperature=0), ignore_eos=True).tokens[0]


@pytest.fixture(scope="module", params=SCHEMES, ids=lambda q: f"{q.name}{'-output' if q.output else ''}")
def quantized(request):
    shape = get_shape("tiny")
    state = random_weights(shape, torch.float32, seed=5)
    quant = request.param
    return quantize_state(state, shape, quant, torch.float32), quant


@pytest.fixture(scope="module")
def eager_tokens(quantized):
    return greedy(*quantized, "none")


@pytest.mark.parametrize("mode", [m for m in COMPILE_MODES if m != "none"])
def test_every_compile_mode_gives_the_eager_tokens(quantized, eager_tokens, mode):
    assert greedy(*quantized, mode) == eager_tokens


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_repacked_layers_prefill_compiled_matches_a_float64_product(scheme):
    """A bf16 layer repacked for our Triton kernel (its checkpoint layout dropped) computes a prefill's rows from
    the repacked words, compiled as ``--compile_prefill`` compiles it."""
    from gpt_fast.quant.layers import Int4Linear, Int8Linear

    torch.manual_seed(3)
    weight = torch.randn(1024, 4096, device="cuda")
    if scheme == "int8":
        layer = Int8Linear(4096, 1024, QuantConfig("int8"), bias=False)
        q, s = quantize_int8(weight, torch.bfloat16)
        layer.load_state_dict({"weight": q, "scales": s}, assign=True)
        matrix = dequantize_int8(q, s)
    else:
        layer = Int4Linear(4096, 1024, QuantConfig("int4", 128), bias=False)
        q, s, z = quantize_int4(weight, 128, torch.bfloat16)
        layer.load_state_dict({"weight": q, "scales": s, "zeros": z}, assign=True)
        matrix = dequantize_int4(q, s, z, 128)
    layer.prepare(resolve_kernel("triton", torch.device("cuda")))
    assert layer.weight is None
    x = torch.randn(2, 40, 4096, device="cuda", dtype=torch.bfloat16)
    expected = x.double() @ matrix.double().T
    torch._dynamo.reset()
    got = torch.compile(layer)(x).double()
    assert relative_error(got, expected) < 1e-2


needs_gemlite = pytest.mark.skipif(importlib.util.find_spec("gemlite") is None, reason="needs gemlite")


@needs_gemlite
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(4096, 4096), (11008, 4096), (1536, 576)])
def test_gemlite_takes_a_batched_steps_int8_rows_and_compiles_into_a_cuda_graph(dtype, n, k):
    """An int8 layer prepared for ``gemlite`` matches a float64 product with the dequantized weights at every row
    count (one row and prompts on our kernels, GEMLITE_ROWS on gemlite's), and in a CUDA-graph step compiled as
    the server compiles its step."""
    from gpt_fast.quant.layers import Int8Linear
    from gpt_fast.quant.products import GEMLITE_ROWS

    torch.manual_seed(n + k)
    layer = Int8Linear(k, n, QuantConfig("int8"), bias=False)
    q, s = quantize_int8(torch.randn(n, k, device="cuda"), dtype)
    layer.load_state_dict({"weight": q, "scales": s}, assign=True)
    layer.prepare(resolve_kernel("gemlite", torch.device("cuda")))
    assert layer.batched is not None and layer.weight is None
    matrix = dequantize_int8(q, s).double()
    for rows in (1, 3, GEMLITE_ROWS.start, 16, 32, GEMLITE_ROWS.stop - 1, 300):
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        assert relative_error(layer(x), x.double() @ matrix.T) < 1e-2, rows
    torch._dynamo.reset()
    step = torch.compile(lambda rows: layer(torch.sigmoid(rows)) * 2, mode="reduce-overhead")
    x = torch.randn(GEMLITE_ROWS.start, k, device="cuda", dtype=dtype)
    for _ in range(3):  # warm-up (gemlite tunes its kernel), recording, replay
        got = step(x).clone()
    assert relative_error(got, (torch.sigmoid(x).double() @ matrix.T) * 2) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [17, 64, 300])
@pytest.mark.parametrize("n, k, group", [(4096, 4096, 128), (1000, 576, 32), (96, 200, 64), (22016, 4096, 256)])
def test_a_prompts_rows_take_the_matmul_of_the_words(dtype, rows, n, k, group):
    """More rows than a decode step's through a 16-bit layer repacked for our Triton kernels take our matrix
    product of the words as they lie (:mod:`gpt_fast.kernels.triton_matmul`), in its tile for that many rows, and
    match a float64 product with the dequantized weights."""
    from gpt_fast.quant.layers import Int4Linear, Int8Linear
    from gpt_fast.quant.products import INT4_GEMV_ROWS, takes_matmul

    torch.manual_seed(n + k + rows)
    weight = torch.randn(n, k, device="cuda")
    x = torch.randn(1, rows, k, device="cuda", dtype=dtype)
    assert takes_matmul(x[0], INT4_GEMV_ROWS)
    layer = Int4Linear(k, n, QuantConfig("int4", group), bias=False)
    q, s, z = quantize_int4(weight, group, dtype)
    layer.load_state_dict({"weight": q, "scales": s, "zeros": z}, assign=True)
    layer.prepare(resolve_kernel("triton", torch.device("cuda")))
    assert relative_error(layer(x), x.double() @ dequantize_int4(q, s, z, group).double().T) < 1e-2
    if k % INT8_BLOCK == 0:
        layer = Int8Linear(k, n, QuantConfig("int8"), bias=False)
        q, s = quantize_int8(weight, dtype)
        layer.load_state_dict({"weight": q, "scales": s}, assign=True)
        layer.prepare(resolve_kernel("triton", torch.device("cuda")))
        assert layer.weight is None
        assert relative_error(layer(x), x.double() @ dequantize_int8(q, s).double().T) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k, group", [(256, 4096, 128), (96, 200, 64), (130, 576, 32)])
def test_a_batched_steps_int4_rows_widen_every_weight_as_pytorch_dequantizes_it(dtype, n, k, group):
    """One-hot rows read each weight of :func:`gpt_fast.kernels.triton_matmul.int4_rows` back exactly: every
    weight equals PyTorch's dequantization in the activations' dtype, bit for bit (bfloat16: PTX's pairs on an
    NVIDIA GPU; float16: Triton's)."""
    from gpt_fast.kernels import triton_matmul
    from gpt_fast.quant.products import int4_dequantize

    torch.manual_seed(n + k)
    q, s, z = quantize_int4(torch.randn(n, k, device="cuda"), group, dtype)
    words, eye = group_interleave(q, group), torch.eye(k, device="cuda", dtype=dtype)
    assert triton_matmul.pair_widening(eye) == (dtype == torch.bfloat16)
    got = torch.cat([triton_matmul.int4_rows(eye[i : i + 64], words, s, z, group) for i in range(0, k, 64)])
    assert torch.equal(got.T, int4_dequantize(q, s, z, group))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("n, k, group", [(4096, 4096, 128), (1536, 576, 64), (96, 256, 32)])
def test_tinygemm_int4_matches_a_float64_product(rows, n, k, group):
    """The int4 layer repacked for PyTorch's CUDA tinygemm kernel (``aten`` on CUDA, bf16)."""
    from gpt_fast.quant.layers import Int4Linear

    torch.manual_seed(n + k + rows)
    weight = torch.randn(n, k, device="cuda")
    q, s, z = quantize_int4(weight, group, torch.bfloat16)
    layer = Int4Linear(k, n, QuantConfig("int4", group), bias=False)
    layer.load_state_dict({"weight": q, "scales": s, "zeros": z}, assign=True)
    layer.prepare("aten")
    assert layer.kernel == "aten"
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    expected = x.double() @ dequantize_int4(q, s, z, group).double().T
    got = layer(x).double()
    assert relative_error(got, expected) < 1e-2


def row_operands(scheme: str, n: int, k: int, dtype: torch.dtype):
    """A quantized [n, k] matrix repacked for our kernels, as ``(plain product, row product)`` of the operators."""
    from gpt_fast.quant.products import int4_triton_linear, int8_linear

    weight = torch.randn(n, k, device="cuda") / k**0.5
    if scheme == "int8":
        q, s = quantize_int8(weight, dtype)
        words = int8_interleave(q)
        plain = functools.partial(int8_linear, weight=words, scales=s, kernel="triton", pdl=True)
        return plain, functools.partial(torch.ops.gpt_fast.int8_row, words=words, scales=s)
    q, s, z = quantize_int4(weight, 128, dtype)
    words = group_interleave(q, 128)
    plain = functools.partial(int4_triton_linear, words=words, scales=s, zeros=z, group_size=128, pdl=True)
    return plain, functools.partial(torch.ops.gpt_fast.int4_row, words=words, scales=s, zeros=z, group_size=128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_rows_neighbours_inside_the_quantized_kernels_are_the_models(scheme, dtype):
    """``int8_row`` and ``int4_row`` (the float16-pairs PTX) with the RMSNorm before the product, the residual
    added after it, or a gated MLP's activation after ``w13``, against the same operator's plain product with the
    model's own norm, add and activation around it, each compiled in a CUDA graph after a kernel of inductor's
    (as in a decode step): the same up to the norm's sum of squares, summed in another order (1e-3)."""
    from gpt_fast.model.transformer import gated, rms_norm
    from gpt_fast.quant.products import register_triton_ops

    register_triton_ops()
    torch.manual_seed(11)
    k, hidden = 4096, 1408
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    norm_weight = (1 + torch.randn(k, device="cuda") / 10).to(dtype)
    residual = torch.randn(1, k, device="cuda", dtype=dtype)
    plain, row = row_operands(scheme, k, k, dtype)
    plain13, row13 = row_operands(scheme, 2 * hidden, k, dtype)
    pairs = {
        "normed": (
            lambda v: row(v, residual=None, norm_weight=norm_weight, eps=1e-5, activation=None),
            lambda v: plain(rms_norm(v, norm_weight, 1e-5, 0.0)),
        ),
        "plus residual": (
            lambda v: row(v, residual=residual, norm_weight=None, eps=0.0, activation=None),
            lambda v: residual + plain(v),
        ),
    }
    for activation in ("silu", "gelu_tanh"):
        pairs[f"gated {activation}"] = (
            lambda v, a=activation: row13(v, residual=None, norm_weight=norm_weight, eps=1e-5, activation=a),
            lambda v, a=activation: gated(*plain13(rms_norm(v, norm_weight, 1e-5, 0.0)).split(hidden, dim=-1), a),
        )
    for name, (inside, outside) in pairs.items():
        torch._dynamo.reset()
        step = torch.compile(lambda v, f=inside: f(torch.sigmoid(v) * 4), mode="reduce-overhead")
        for _ in range(3):  # warm-up, recording, replay
            got = step(x).clone()
        expected = outside(torch.sigmoid(x) * 4)
        assert got.shape == expected.shape and got.dtype == dtype, name
        assert relative_error(got, expected) < 1e-3, name


@pytest.mark.parametrize("scheme", SCHEMES[:2], ids=lambda q: q.name)
def test_a_quantized_bf16_step_runs_each_layer_as_four_row_kernels(scheme):
    """A bf16 model quantized for our kernels, its decode step compiled in ``reduce-overhead`` with our linear
    kernel: each layer runs through :class:`gpt_fast.accel.linear.FusedRow` (norms, residual adds and the
    activation inside the quantized products) and its logits are the eager step's within bf16 rounding."""
    import dataclasses

    from gpt_fast.accel.linear import FusedRow, register_triton_ops, use_linear_kernel
    from gpt_fast.checkpoint.load import model_from_state

    shape = dataclasses.replace(get_shape("tiny"), intermediate_size=128)  # int8 words: columns in 64s
    state = quantize_state(random_weights(shape, torch.float32, seed=2), shape, scheme, torch.bfloat16)
    model = model_from_state(shape, state, torch.device("cuda"), torch.bfloat16, scheme, kernel="triton")
    model.setup_caches(1, 64)
    tokens, pos = torch.tensor([[7]], device="cuda"), torch.tensor([5], device="cuda")
    with torch.no_grad():
        model(torch.arange(5, device="cuda")[None], torch.arange(5, device="cuda"))
        expected = model(tokens, pos).clone()
        register_triton_ops()
        use_linear_kernel(model, "triton")
        assert all(block.row_kernels is FusedRow for block in model.layers)
        torch._dynamo.reset()
        step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            got = step(tokens, pos).clone()
    assert relative_error(got, expected) < 2e-2
