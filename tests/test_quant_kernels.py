"""The quantized products on the CPU, each kernel against a float64 product with the dequantized weights; the
Triton kernels too, in Triton's interpreter, where Triton is installed."""

import importlib.util
import json
import textwrap

import pytest
import torch

from gpt_fast.model.config import QuantConfig
from gpt_fast.quant.layers import Int4Linear, Int8Linear
from gpt_fast.quant.products import (
    FEW_ROWS,
    group_deinterleave,
    group_interleave,
    int4_dequantize,
    int4_linear,
    int8_interleave,
    int8_linear,
    resolve_kernel,
)
from gpt_fast.quant.schemes import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8, unpack_int4
from tests.interpreter import interpret_all, needs_triton, old_numpy

# Relative error ||ours - exact|| / ||exact|| allowed against the float64 product: float32 arithmetic lands near
# 1e-6; bfloat16 activations and scales (8 bits of mantissa) near 3e-3.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def relative_error(got, expected):
    return ((got.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("kernel", ["aten", "dequant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, FEW_ROWS + 3])
def test_int8_matches_the_float_product(kernel, dtype, rows):
    torch.manual_seed(rows)
    q, scales = quantize_int8(torch.randn(96, 160), dtype)
    x = torch.randn(2, rows, 160, dtype=dtype)
    expected = x.double() @ dequantize_int8(q, scales).double().T
    got = int8_linear(x, q, scales, kernel)
    assert got.shape == (2, rows, 96) and got.dtype == dtype
    assert relative_error(got, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("kernel", ["aten", "dequant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, FEW_ROWS + 3])
@pytest.mark.parametrize("cols, group_size", [(256, 32), (576, 128), (200, 256)])
def test_int4_matches_the_float_product(kernel, dtype, rows, cols, group_size):
    """Through the layer, so that ``aten`` runs on its repacked copy (rows padded to whole groups)."""
    torch.manual_seed(cols + rows)
    q, scales, zeros = quantize_int4(torch.randn(64, cols), group_size, dtype)
    layer = Int4Linear(cols, 64, QuantConfig("int4", group_size), bias=False)
    layer.load_state_dict({"weight": q, "scales": scales, "zeros": zeros}, assign=True)
    layer.prepare(kernel)
    assert layer.kernel == kernel
    x = torch.randn(rows, cols, dtype=dtype)
    expected = x.double() @ dequantize_int4(q, scales, zeros, group_size).double().T
    got = layer(x)
    assert got.shape == (rows, 64) and got.dtype == dtype
    assert relative_error(got, expected) < TOLERANCE[dtype]


def test_int4_dequantize_in_pytorch_matches_the_scheme():
    q, scales, zeros = quantize_int4(torch.randn(32, 200), 64, torch.float32)
    torch.testing.assert_close(int4_dequantize(q, scales, zeros, 64), dequantize_int4(q, scales, zeros, 64))
    x = torch.randn(3, 200)
    torch.testing.assert_close(int4_linear(x, q, scales, zeros, 64), x @ dequantize_int4(q, scales, zeros, 64).T)


@pytest.mark.parametrize("cols, group_size", [(256, 64), (200, 32), (576, 128)])
def test_group_interleave_puts_each_column_where_the_triton_kernel_reads_it(cols, group_size):
    """Column c of group g = c // group_size, at r = c % group_size within it, sits in word g * group_size / 8 +
    (r // 2) % (group_size / 8) of its row, nibble (r // 2) // (group_size / 8) + 4 (r % 2): each pair of nibbles k
    and k + 4 holds two adjacent columns; a shorter last group is padded with zeros."""
    torch.manual_seed(cols)
    q, _, _ = quantize_int4(torch.randn(3, cols), group_size, torch.float32)
    words = group_interleave(q, group_size)
    per_group = group_size // 8
    groups = -(-cols // group_size)
    assert words.dtype == torch.int32 and words.shape == (3, groups * per_group)
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [3, words, 8]
    col = torch.arange(groups * group_size)
    r = col % group_size
    read = nibbles[:, (col // group_size) * per_group + (r // 2) % per_group, (r // 2) // per_group + 4 * (r % 2)]
    levels = unpack_int4(q)
    assert torch.equal(read[:, :cols], levels.to(read.dtype))
    assert not read[:, cols:].any()


@pytest.mark.parametrize("cols, group_size", [(256, 64), (200, 32), (576, 128)])
def test_group_deinterleave_gives_back_the_levels(cols, group_size):
    torch.manual_seed(cols)
    q, _, _ = quantize_int4(torch.randn(5, cols), group_size, torch.float32)
    assert torch.equal(group_deinterleave(group_interleave(q, group_size), group_size, cols), unpack_int4(q))


def test_a_layer_prepared_for_the_triton_kernel_keeps_one_copy_and_prefills_from_it():
    """``triton`` repacks the weights into ``words``, which replace ``weight`` (counted among the parameters, as the
    bytes a token reads); more rows than the Triton kernel takes (a prefill) dequantize ``words``: the product
    of the checkpoint's own weights."""
    torch.manual_seed(0)
    layer = Int4Linear(200, 48, QuantConfig("int4", 32), bias=False)
    q, scales, zeros = quantize_int4(torch.randn(48, 200), 32, torch.float32)
    layer.load_state_dict({"weight": q, "scales": scales, "zeros": zeros}, assign=True)
    layer.prepare("triton")
    assert layer.weight is None
    assert [name for name, _ in layer.named_parameters()] == ["scales", "zeros", "words"]
    x = torch.randn(2, 20, 200)
    expected = x @ dequantize_int4(q, scales, zeros, 32).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_int8_interleave_puts_each_column_where_the_triton_kernel_reads_it():
    """Column c of block b = c // 64, at r = c % 64 within it, sits in word 16 b + 2 ((r % 32) // 4) + r // 32 of
    its row, byte r % 4, as q + 128 (a prefill reads it so: see the layer's test below)."""
    torch.manual_seed(1)
    q, _ = quantize_int8(torch.randn(3, 192), torch.float32)
    words = int8_interleave(q)
    assert words.dtype == torch.int32 and words.shape == (3, 48)
    col = torch.arange(192)
    r = col % 64
    read = words.view(torch.uint8).reshape(3, 48, 4)[:, 16 * (col // 64) + 2 * ((r % 32) // 4) + r // 32, r % 4]
    assert torch.equal(read.to(torch.int16) - 128, q.to(torch.int16))


@pytest.mark.parametrize("kernel", ["triton", "aten", "dequant"])
def test_an_int8_layer_prepared_for_the_triton_kernel_keeps_one_copy_and_prefills_from_it(kernel):
    """In a 16-bit model whose inputs are a multiple of 64, ``triton`` repacks the weights into ``words``, which
    replace ``weight`` (counted among the parameters, as the bytes a token reads); a prefill multiplies them by
    its rows' columns put in their order: the product of the checkpoint's own weights. Other widths, float32
    models and the other kernels keep ``weight``."""
    torch.manual_seed(0)
    for cols, dtype in [(192, torch.bfloat16), (200, torch.bfloat16), (192, torch.float32)]:
        repacked = kernel == "triton" and cols % 64 == 0 and dtype != torch.float32
        layer = Int8Linear(cols, 40, QuantConfig("int8"), bias=False)
        q, scales = quantize_int8(torch.randn(40, cols), dtype)
        layer.load_state_dict({"weight": q, "scales": scales}, assign=True)
        layer.prepare(kernel)
        assert (layer.weight is None) == repacked
        names = ["scales", "words"] if repacked else ["weight", "scales"]
        assert [name for name, _ in layer.named_parameters()] == names
        x = torch.randn(2, FEW_ROWS + 4, cols, dtype=dtype)
        expected = x.double() @ dequantize_int8(q, scales).double().T
        assert relative_error(layer(x), expected) < TOLERANCE[dtype]


def test_cpu_int4_kernel_needs_rows_in_sixteens():
    """torch's CPU int4 kernel takes 16 output rows at a time; another shape keeps the plain PyTorch path."""
    layer = Int4Linear(64, 24, QuantConfig("int4", 32), bias=False)
    q, scales, zeros = quantize_int4(torch.randn(24, 64), 32, torch.float32)
    layer.load_state_dict({"weight": q, "scales": scales, "zeros": zeros}, assign=True)
    layer.prepare("aten")
    assert layer.kernel == "dequant"


def test_kernel_choice():
    """``auto`` on the CPU: tests/test_quant_cpu_kernels.py."""
    cpu = torch.device("cpu")
    assert resolve_kernel("dequant", cpu) == "dequant"
    with pytest.raises(ValueError, match="the triton quantized kernels need a CUDA GPU"):
        resolve_kernel("triton", cpu)
    with pytest.raises(ValueError, match="gemlite quantized kernel needs a CUDA GPU with Triton and the gemlite"):
        resolve_kernel("gemlite", cpu)
    with pytest.raises(
        ValueError, match="quantized kernel 'fast' is not one of auto, triton, gemlite, cpp, cpp-q8, aten"
    ):
        resolve_kernel("fast", cpu)


def test_an_int8_layer_gives_gemlite_only_a_batched_steps_rows_of_a_16_bit_model(monkeypatch):
    """``gemlite`` prepares ``triton``'s words and, in a 16-bit model, gemlite's copy of the weights (here
    PyTorch's product of the dequantized matrix stands in for gemlite's kernel, which needs a GPU;
    tests/test_quant_gpu.py runs the real one): products of GEMLITE_ROWS rows go to that copy, and a float32
    model, an embedding table and an int4 layer keep what ``triton`` gives them."""
    from gpt_fast.quant import layers
    from gpt_fast.quant.products import GEMLITE_ROWS

    def weights(weight, scales):
        return layers.GemliteWeights([dequantize_int8(weight, scales).to(scales.dtype)], [])

    calls = []
    monkeypatch.setattr(layers, "gemlite_int8_weights", weights)
    monkeypatch.setattr(
        layers, "gemlite_int8_product", lambda rows, w: calls.append(rows.shape[0]) or rows @ w.tensors[0].T
    )
    torch.manual_seed(0)
    for dtype, batched in [(torch.bfloat16, True), (torch.float32, False)]:
        layer = Int8Linear(192, 40, QuantConfig("int8"), bias=False)
        q, scales = quantize_int8(torch.randn(40, 192), dtype)
        layer.load_state_dict({"weight": q, "scales": scales}, assign=True)
        layer.prepare("gemlite")
        assert layer.kernel == "triton" and (layer.batched is not None) == batched
        assert [name for name, _ in layer.named_parameters()] == (
            ["scales", "words"] if batched else ["weight", "scales"]
        )
        if batched:
            for rows in (GEMLITE_ROWS.start, GEMLITE_ROWS.stop - 1, GEMLITE_ROWS.stop):
                x = torch.randn(rows, 192, dtype=dtype)
                expected = x.double() @ dequantize_int8(q, scales).double().T
                assert relative_error(layer(x), expected) < TOLERANCE[dtype]
    assert calls == [GEMLITE_ROWS.start, GEMLITE_ROWS.stop - 1]
    int4 = Int4Linear(256, 24, QuantConfig("int4", 32), bias=False)
    q4, s4, z4 = quantize_int4(torch.randn(24, 256), 32, torch.bfloat16)
    int4.load_state_dict({"weight": q4, "scales": s4, "zeros": z4}, assign=True)
    int4.prepare("gemlite")
    assert int4.kernel == "triton" and int4.weight is None


def test_a_rocm_build_falls_back_to_plain_pytorch(monkeypatch):
    """On ROCm (and on a CUDA build without Triton) a GPU's layers dequantize and call F.linear."""
    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert resolve_kernel("auto", gpu) == "dequant"
    with pytest.raises(ValueError, match="the triton quantized kernels need a CUDA GPU with Triton installed"):
        resolve_kernel("triton", gpu)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert resolve_kernel("auto", gpu) == "dequant"


# rows, n, k, own tiles. The interpreter runs a launch's programs one after another, each step of each in Python:
# the cost is programs times steps, whatever a program's tile holds. So n is only as large as the paths need: 16 and 8
# are multiples of every tile's rows (1, 2, 4, 8: the unmasked paths, several programs per row where the tile is
# smaller than n), 5 leaves every tile of several rows a last program with masked rows (the loads are masked for the
# whole launch, EVEN, so a whole program before it would run the same code); k = 1024 is the one that
# float32 int4's default tile of 1024 columns divides. It runs the default tiles alone ("own tiles" False): the test's
# own tiles run unmasked at (1, 16, 256) already, with the same code at each step, and at k = 1024 took 4 times the
# steps, a third of the test's time.
INTERPRETED_SHAPES = [(1, 16, 256, True), (3, 5, 200, True), (2, 8, 1024, False), (3, 5, 192, True)]
TRITON_CHECK = """
import torch
from gpt_fast.kernels import triton_gemv
from gpt_fast.quant.products import INT8_BLOCK, group_interleave, int8_interleave
from gpt_fast.quant.schemes import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
torch.manual_seed(0)
worst = 0.0
worst_half2 = {torch.float16: 0.0, torch.bfloat16: 0.0}
for rows, n, k, own_tiles in SHAPES:
    w, x = torch.randn(n, k), torch.randn(rows, k)
    q, s = quantize_int8(w, torch.float32)
    exact = x.double() @ dequantize_int8(q, s).double().T
    for launch in [None, *own_tiles * [triton_gemv.Launch(4, 128, 4), triton_gemv.Launch(1, 256, 2, words=True)]]:
        got = triton_gemv.int8_gemv(x, q, s, launch).double()
        worst = max(worst, ((got - exact).norm() / exact.norm()).item())
    for dtype in (torch.float16, torch.bfloat16) if k % INT8_BLOCK == 0 else ():
        q16, s16 = quantize_int8(w, dtype)
        half = x.to(dtype)
        exact16 = half.double() @ dequantize_int8(q16, s16).double().T
        for launch in [None, *own_tiles * [triton_gemv.Launch(2, 128, 2), triton_gemv.Launch(8, 64, 1)]]:
            got = triton_gemv.int8_gemv(half, int8_interleave(q16), s16, launch).double()
            worst_half2[dtype] = max(worst_half2[dtype], ((got - exact16).norm() / exact16.norm()).item())
    for group in (32, 128):
        q, s, z = quantize_int4(w, group, torch.float32)
        exact = x.double() @ dequantize_int4(q, s, z, group).double().T
        words = group_interleave(q, group)
        for launch in [None, *own_tiles * [triton_gemv.Launch(4, 2 * group, 2), triton_gemv.Launch(2, group, 1)]]:
            got = triton_gemv.int4_gemv(x, words, s, z, group, launch).double()
            worst = max(worst, ((got - exact).norm() / exact.norm()).item())
        for dtype in (torch.float16, torch.bfloat16):
            q, s, z = quantize_int4(w, group, dtype)
            half = x.to(dtype)
            exact = half.double() @ dequantize_int4(q, s, z, group).double().T
            for launch in [None, *own_tiles * [triton_gemv.Launch(4, 2 * group, 2, half2=True)]]:
                got = triton_gemv.int4_gemv(half, group_interleave(q, group), s, z, group, launch).double()
                worst_half2[dtype] = max(worst_half2[dtype], ((got - exact).norm() / exact.norm()).item())
print(worst, worst_half2[torch.float16], worst_half2[torch.bfloat16])
"""


@pytest.mark.slow
@needs_triton
@old_numpy
def test_triton_kernels_in_the_interpreter():
    """The int8 kernels (the matrix as bytes and as 32-bit words; the words of ``int8_interleave``) and the int4
    kernel, ragged shapes included, run by Triton's interpreter on CPU tensors (TRITON_INTERPRET is read when the
    kernels are defined: a process of its own). With 16-bit activations interleaved int8 and int4 sum in float16
    pairs: the interpreter runs no PTX, so it checks those paths' layout and scaling through the same float16
    arithmetic written in Triton (the PTX has GPU tests), for float16 and bfloat16 activations, within the
    rounding of the output."""
    scripts = [textwrap.dedent(TRITON_CHECK).replace("SHAPES", repr([shape])) for shape in INTERPRETED_SHAPES]
    outputs = [[float(value) for value in out.split()] for out in interpret_all([["-c", s] for s in scripts])]
    worst, worst_float16, worst_bfloat16 = (max(column) for column in zip(*outputs, strict=True))
    assert worst < 1e-5
    assert worst_float16 < 2e-3
    assert worst_bfloat16 < 6e-3  # the interpreter rounds float32 to bfloat16 toward zero: up to 2 ** -8


INSIDE_CHECK = """
import json, torch
from gpt_fast.model.transformer import gated, rms_norm
from gpt_fast.kernels import triton_gemv
from gpt_fast.quant.products import group_interleave, int8_interleave
from gpt_fast.quant.schemes import quantize_int4, quantize_int8
from gpt_fast.kernels.triton_gemv import NOTHING_INSIDE, Inside
worst = {}
for dtype in DTYPES:
    # n: whole tiles of 8 and 16 rows (a gated tile's 8 gate and 8 up rows); then one tile of each with masked rows
    # (the loads are masked for the whole launch, so a whole tile before it would run the same code)
    for rows, n, k in [(1, 32, 256), (2, 6, 192)]:
        g = torch.Generator().manual_seed(n * k)
        w = torch.randn(n, k, generator=g) / k**0.5
        x = (3 * torch.randn(rows, k, generator=g)).to(dtype)
        norm_weight = (1 + torch.randn(k, generator=g) / 10).to(dtype)
        residual = torch.randn(rows, n, generator=g).to(dtype)
        normed = rms_norm(x, norm_weight, 1e-5, 0.0)
        q, s = quantize_int8(w, dtype)
        q4, s4, z4 = quantize_int4(w, 64, dtype)
        products = {
            "int8": lambda v, inside=NOTHING_INSIDE: triton_gemv.int8_gemv(v, int8_interleave(q), s, inside=inside),
            "int4": lambda v, inside=NOTHING_INSIDE: triton_gemv.int4_gemv(
                v, group_interleave(q4, 64), s4, z4, 64, inside=inside
            ),
        }
        for scheme, product in products.items():
            up = product(normed)
            pairs = {
                "normed": (product(x, Inside(norm_weight, 1e-5)), up),
                "plus residual": (product(x, Inside(residual=residual)), (residual.float() + product(x)).to(dtype)),
            }
            for act in ("silu", "gelu_tanh"):
                pairs[f"gated {act}"] = (
                    product(x, Inside(norm_weight, 1e-5, activation=act)),
                    gated(up[:, : n // 2], up[:, n // 2 :], act),
                )
            for name, (got, want) in pairs.items():
                assert got.shape == want.shape and got.dtype == dtype, name
                key = f"{scheme} {name} {str(dtype)[6:]}"
                error = ((got.double() - want.double()).norm() / want.double().norm()).item()
                worst[key] = max(worst.get(key, 0.0), error)
print(json.dumps(worst))
"""


@pytest.mark.slow
@needs_triton
@old_numpy
def test_the_kernels_compute_a_rows_neighbours_inside_as_the_model_does():
    """Interleaved int8 and int4 in float16 pairs, in Triton's interpreter, with the RMSNorm of the activations
    before the product, the residual added after it, or a gated MLP's activation after ``w13``, against the same
    kernel's plain product with the model's own norm, add and activation around it (its row of gate and up
    outputs). float16: the same numbers. bfloat16: the interpreter rounds float32 to bfloat16 toward zero where
    torch rounds to nearest (the norm's two roundings, the activation's two), so within those truncations; on the
    GPU the kernels round as torch does (tests/test_quant_gpu.py: 1e-3)."""
    dtypes = ("(torch.float16,)", "(torch.bfloat16,)")  # a process each
    worst: dict[str, float] = {}
    for out in interpret_all([["-c", INSIDE_CHECK.replace("DTYPES", d)] for d in dtypes]):
        worst |= json.loads(out)
    assert len(worst) == 2 * 2 * 4
    for key, error in worst.items():
        assert error <= (0.0 if key.endswith(" float16") else 4e-2 if "gated" in key else 1e-2), (key, error)


def compile_for_h200(name: str, dtype: str, constants: dict, warps: int):
    """Our kernel ``name`` compiled on the CPU for an H200 (``sm_90``), launched with PDL, as its launcher would
    specialize it for aligned tensors and dimensions divisible by 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpt_fast.kernels import triton_gemv

    kernel = getattr(triton_gemv, name)
    pointers = {"x_ptr": dtype, "w_ptr": "i32", "s_ptr": dtype, "z_ptr": dtype, "y_ptr": dtype}
    pointers |= {"r_ptr": dtype, "g_ptr": dtype}
    kinds = {p: "*" + pointers[p] if p in pointers else "fp32" if p == "eps" else "i32" for p in kernel.arg_names}
    signature = {p: "constexpr" if p in constants else kinds[p] for p in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.arg_names) if p not in constants | {"M": 0}}
    return triton.compile(
        ASTSource(
            kernel, signature, constexprs={(kernel.arg_names.index(p),): v for p, v in constants.items()}, attrs=aligned
        ),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "launch_pdl": True},
    )


def inside_constants(inside: str) -> dict[str, object]:
    """The kernels' constants for what else they compute: ``nothing``, ``norm and activation`` (a gated MLP's
    ``w13``) or ``residual``."""
    gated = inside == "norm and activation"
    return {"NORM": gated, "RESIDUAL": inside == "residual", "GATED": gated, "GELU": False, "ROW_K": 4096}


@needs_triton
@pytest.mark.parametrize(
    "name, inside",
    [
        ("_int8_gemv", None),
        ("_int8_interleaved_gemv", "nothing"),
        ("_int8_interleaved_gemv", "norm and activation"),
        ("_int8_interleaved_gemv", "residual"),
        ("_int4_gemv", "nothing"),
        ("_int4_gemv", "norm and activation"),
        ("_int4_gemv", "residual"),
    ],
)
def test_the_kernels_compile_for_an_h200_with_their_first_weights_loaded_before_the_wait(name, inside):
    """Launched with PDL (the ``_pdl`` and ``_row`` operators), the first step's weights are loaded before
    ``griddepcontrol.wait``, and dependents are released only after it (the rule of
    :mod:`gpt_fast.kernels.pdl`), with a norm, an activation or a residual inside too; the float16-pairs PTX of
    interleaved int8 and of int4 assembles for ``sm_90``."""
    from gpt_fast.kernels import triton_gemv

    if name == "_int8_gemv":
        constants = {"BLOCK_N": 8, "BLOCK_K": 2048, "EVEN": True, "AS_WORDS": True, "PDL": True}
        warps = 4
    elif name == "_int8_interleaved_gemv":
        launch = triton_gemv.int8_launch(4096, 4096, interleaved=True)
        constants = {"BLOCK_N": launch.block_n, "BLOCKS": launch.block_k // 64, "EVEN": True}
        constants |= {"BF16": True, "ASM": True, "PDL": True} | inside_constants(inside)
        warps = launch.warps
    else:
        launch = triton_gemv.int4_launch(4096, 128)
        constants = {"BLOCK_N": launch.block_n, "GROUPS": launch.block_k // 128, "GROUP": 128, "EVEN": True}
        constants |= {"HALF2": True, "BF16": True, "ASM": True, "PDL": True} | inside_constants(inside)
        warps = launch.warps
    compiled = compile_for_h200(name, "bf16", constants, warps)
    lines = compiled.asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    release = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
    assert any("ld.global" in line for line in lines[:wait])
    assert release > wait
    assert "cubin" in compiled.asm


@needs_triton
@pytest.mark.parametrize("dtype, half2", [("fp32", False), ("bf16", False), ("fp16", True), ("bf16", True)])
@pytest.mark.parametrize("group, even", [(32, False), (256, True)])
def test_the_int4_kernel_compiles_for_an_h200_in_each_path(dtype, half2, group, even):
    """Each path of the int4 kernel (float32 arithmetic, float16 pairs from float16 or bfloat16 activations;
    masked or not) compiles to a cubin for ``sm_90``: the interpreter runs what the compiler may refuse."""
    from gpt_fast.kernels import triton_gemv

    launch = triton_gemv.int4_launch(22016, group, half2)
    constants = {"BLOCK_N": launch.block_n, "GROUPS": launch.block_k // group, "GROUP": group, "EVEN": even}
    constants |= {"HALF2": half2, "BF16": dtype == "bf16", "ASM": True, "PDL": True} | inside_constants("nothing")
    assert "cubin" in compile_for_h200("_int4_gemv", dtype, constants, launch.warps).asm


@needs_triton
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("n, k", [(4096, 4096), (4096, 11008)])
def test_the_int8_interleaved_kernel_compiles_for_an_h200_in_each_path(dtype, n, k):
    """The int8 kernel of interleaved words, from float16 or bfloat16 activations, masked where the tile does not
    divide the columns or not, compiles to a cubin for ``sm_90``."""
    from gpt_fast.kernels import triton_gemv

    launch = triton_gemv.int8_launch(n, k, interleaved=True)
    constants = {"BLOCK_N": launch.block_n, "BLOCKS": launch.block_k // 64, "EVEN": k % launch.block_k == 0}
    constants |= {"BF16": dtype == "bf16", "ASM": True, "PDL": True} | inside_constants("nothing")
    assert "cubin" in compile_for_h200("_int8_interleaved_gemv", dtype, constants, launch.warps).asm


def test_only_layers_computing_with_the_triton_kernel_launch_it_with_pdl():
    """``launch_with_pdl`` (the engine's call where our GEMVs are launched with PDL) reaches the quantized layers
    under the root it is given that compute with the ``triton`` kernel; eager calls never take the PDL operator."""
    from gpt_fast.model.shapes import get_shape
    from gpt_fast.model.transformer import Transformer
    from gpt_fast.quant.layers import QuantizedLinear, launch_with_pdl, quantize_linears

    shape = get_shape("tiny")
    with torch.device("meta"):
        model = Transformer(shape)
    quantize_linears(model, shape, QuantConfig("int4", 32, output=True))
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for module in quantized:
        module.kernel = "triton"
    model.layers[0].attention.wo.kernel = "aten"
    launch_with_pdl(model.layers, True)
    assert model.output.pdl is False and model.layers[0].attention.wo.pdl is False
    assert sum(m.pdl for m in quantized) == 4 * shape.n_layer - 1
    assert not model.layers[1].attention.wo.launch_pdl()  # not compiling
    launch_with_pdl(model.layers, False)
    assert not any(m.pdl for m in quantized)


def test_batch_invariant_steps_refuse_the_gemlite_kernel():
    """gemlite's kernels take a batched step's rows where ours take one row's: a row's numbers would change with
    the batch."""
    from gpt_fast.accel.options import KernelOptions
    from gpt_fast.engine.options import EngineOptions

    with pytest.raises(ValueError, match="batch_invariant does not combine with kernels.quant gemlite"):
        EngineOptions(compile="reduce-overhead", batch_invariant=True, kernels=KernelOptions(quant="gemlite"))
