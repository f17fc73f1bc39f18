"""Our C++ CPU kernels for the quantized products (``cpp``, :mod:`gpt_fast.kernels.cpu_gemv`) against a float64
product with the dequantized weights, the layers' fallbacks where the kernels do not take a shape or dtype, the
choice of ``auto``, and greedy decoding unchanged against the dequantizing kernel, eager and compiled."""

import dataclasses
import os
import time

import pytest
import torch

from gpt_fast import Engine, EngineOptions, SamplingConfig
from gpt_fast.accel.options import KernelOptions
from gpt_fast.convert.random_init import random_weights
from gpt_fast.kernels import cpu_gemv
from gpt_fast.model.config import EmbeddingQuant, QuantConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.quant.layers import Int4Linear, Int8Embedding, Int8Linear
from gpt_fast.quant.layout import quantize_state
from gpt_fast.quant.products import (
    CPP_INT4_GEMV_ROWS,
    CPP_INT8_GEMV_ROWS,
    CPP_MATMUL_ROWS,
    FEW_ROWS,
    int4_dequantize,
    int8_linear,
    register_cpu_ops,
    resolve_kernel,
)
from gpt_fast.quant.schemes import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

needs_cpp = pytest.mark.skipif(not cpu_gemv.cpu_kernels_usable(), reason="needs an AVX2 CPU, a C++ compiler, ninja")

# Relative error ||ours - exact|| / ||exact|| allowed against the float64 product: the kernels multiply and sum in
# float32 (each weight widened exactly), so they land near 1e-7, as float32's F.linear does.
TOLERANCE = 1e-5


def relative_error(got, expected):
    return ((got.double() - expected).norm() / expected.norm()).item()


def int4_layer(out_features, cols, group_size, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    q, scales, zeros = quantize_int4(torch.randn(out_features, cols), group_size, dtype)
    layer = Int4Linear(cols, out_features, QuantConfig("int4", group_size), bias=False)
    layer.load_state_dict({"weight": q, "scales": scales, "zeros": zeros}, assign=True)
    return layer, dequantize_int4(q, scales, zeros, group_size).double()


def int8_layer(out_features, cols, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    q, scales = quantize_int8(torch.randn(out_features, cols), dtype)
    layer = Int8Linear(cols, out_features, QuantConfig("int8"), bias=False)
    layer.load_state_dict({"weight": q, "scales": scales}, assign=True)
    return layer, dequantize_int8(q, scales).double()


def int8_group_layer(out_features, cols, group_size, dtype=torch.float32, seed=0):
    """An int8 layer with a scale per group of ``group_size`` columns (a tied table's scheme), and its float64
    weights."""
    torch.manual_seed(seed)
    q, scales = quantize_int8(torch.randn(out_features, cols), dtype, group_size)
    layer = Int8Linear(cols, out_features, EmbeddingQuant("int8", group_size), bias=False)
    layer.load_state_dict({"weight": q, "scales": scales}, assign=True)
    return layer, dequantize_int8(q, scales, group_size).double()


@pytest.fixture(params=[True, False], ids=["avx512", "avx2"])
def avx512(request):
    """The kernels with their AVX-512 code where this CPU has it, and without it, as on a CPU that has not."""
    register_cpu_ops()
    torch.ops.gpt_fast.set_avx512(request.param)
    yield
    torch.ops.gpt_fast.set_avx512(True)  # the default: the AVX-512 code wherever the CPU has it


@needs_cpp
@pytest.mark.parametrize("rows", [1, 5, CPP_INT8_GEMV_ROWS, FEW_ROWS, 50, CPP_MATMUL_ROWS])
@pytest.mark.parametrize("out_features, cols", [(96, 160), (24, 176), (40, 576), (17, 1536)])
def test_int8_kernel_matches_the_float_product(rows, out_features, cols, avx512):
    register_cpu_ops()
    torch.manual_seed(rows)
    q, scales = quantize_int8(torch.randn(out_features, cols), torch.float32)
    x = torch.randn(2, rows, cols)
    expected = x.double() @ dequantize_int8(q, scales).double().T
    got = int8_linear(x, q, scales, "cpp")
    assert got.shape == (2, rows, out_features) and got.dtype == torch.float32
    assert relative_error(got, expected) < TOLERANCE


@needs_cpp
@pytest.mark.parametrize("rows", [1, 3, CPP_INT4_GEMV_ROWS, CPP_INT4_GEMV_ROWS + 2, 50])
@pytest.mark.parametrize(
    "out_features, cols, group_size",
    [(96, 256, 32), (40, 576, 64), (33, 576, 128), (24, 1536, 256), (8, 64, 32)],
    ids=["g32", "g64", "g128-short-last-group", "g256", "one-block"],
)
def test_int4_kernel_matches_the_float_product(rows, out_features, cols, group_size, avx512):
    """Through the layer, on the weights as the checkpoint holds them; groups of 32 split a block of 64 columns,
    576 columns in groups of 128 end with a group of 64."""
    assert_the_cpp_layer_matches(*int4_layer(out_features, cols, group_size, seed=rows), rows)


@needs_cpp
@pytest.mark.parametrize(
    "out_features, cols, group_size", [(40, 576, 32), (17, 576, 128), (9, 1536, 256), (3, 96, 32), (5, 80, 64)]
)
def test_int4_dequantization_gives_pytorchs_numbers(out_features, cols, group_size):
    """Our C++ dequantization of the int4 weights is PyTorch's to the bit, in vectors of 16 columns and in the scalar
    loop for what is left (96 columns in groups of 32; 80 in groups of 64 end with a group of 16; 576 in groups of 128
    end with one of 64)."""
    register_cpu_ops()
    torch.manual_seed(cols)
    packed = torch.randint(0, 256, (out_features, cols // 2), dtype=torch.uint8)
    groups = -(-cols // group_size)
    scales, zeros = torch.rand(out_features, groups) / 7, torch.randn(out_features, groups) / 3
    expected = int4_dequantize(packed, scales, zeros, group_size)
    assert torch.equal(cpu_gemv.int4_dequantize(packed, scales, zeros, group_size), expected)


def assert_the_cpp_layer_matches(layer, dequantized, rows):
    """``layer`` takes the ``cpp`` kernel, and its product of ``rows`` random rows is the float64 one's with its
    dequantized weights [N, K]."""
    register_cpu_ops()
    layer.prepare("cpp")
    assert layer.kernel == "cpp"
    x = torch.randn(rows, layer.in_features)
    got = layer(x)
    assert got.shape == (rows, dequantized.shape[0])
    assert relative_error(got, x.double() @ dequantized.T) < TOLERANCE


@needs_cpp
@pytest.mark.parametrize(
    "product, rows", [("int4_gemv", 2), ("int4_matmul", 2), ("int4_matmul", 53)], ids=["gemv", "tile", "tile-53"]
)
def test_int4_kernel_reads_every_level_and_a_zero_of_its_own_per_group(product, rows, avx512):
    """Weights of every level 0..15 at every column position, scales and zeros that differ per group and row: each
    nibble and each group's numbers land where the scheme says (an exact float64 check of small integers), and each
    output where it belongs: 53 rows are two chunks of the tile kernel, the second ending with blocks of 2 rows,
    and 37 outputs are two tasks, the second ending with a block of one."""
    register_cpu_ops()
    out_features, cols, group_size = 37, 128, 32
    levels = (torch.arange(out_features)[:, None] + torch.arange(cols)[None, :] * 7) % 16  # [N, K]
    packed = (levels[:, 0::2] | (levels[:, 1::2] << 4)).to(torch.uint8)
    scales = torch.arange(1, 1 + out_features * 4, dtype=torch.float32).reshape(out_features, 4) / 4
    zeros = -torch.arange(out_features * 4, dtype=torch.float32).reshape(out_features, 4)
    x = torch.randint(-3, 4, (rows, cols)).float()
    expected = x.double() @ dequantize_int4(packed, scales, zeros, group_size).double().T
    got = getattr(cpu_gemv, product)(x, packed, scales, zeros, group_size)
    assert torch.equal(got.double(), expected)


@needs_cpp
@pytest.mark.parametrize("rows", [1, 3, CPP_INT8_GEMV_ROWS, FEW_ROWS + 2, 50])
@pytest.mark.parametrize("out_features, cols, group_size", [(96, 576, 32), (40, 256, 64), (17, 512, 128), (8, 32, 32)])
def test_grouped_int8_kernel_matches_the_float_product(rows, out_features, cols, group_size, avx512):
    """Through the layer, on the weights and per-group scales as the checkpoint holds them."""
    assert_the_cpp_layer_matches(*int8_group_layer(out_features, cols, group_size, seed=rows), rows)


def every_int8_value(out_features: int, cols: int) -> torch.Tensor:
    """int8 weights [N, K] with every value -128..127 at every column position."""
    return ((torch.arange(out_features)[:, None] * 31 + torch.arange(cols)[None, :] * 7) % 256 - 128).to(torch.int8)


@needs_cpp
@pytest.mark.parametrize("group_size", [16, 32])
@pytest.mark.parametrize("tile", [False, True], ids=["gemv", "tile"])
def test_grouped_int8_kernel_reads_every_value_and_each_groups_scale(group_size, tile, avx512):
    """Weights of every value -128..127 at every column position and scales that differ per group and row: each
    byte and each group's scale land where the scheme says (an exact float64 check of small numbers)."""
    register_cpu_ops()
    out_features, cols = 19, 256
    groups = cols // group_size
    q = every_int8_value(out_features, cols)
    scales = torch.arange(1, 1 + out_features * groups, dtype=torch.float32).reshape(out_features, groups) / 4
    x = torch.randint(-3, 4, (52 if tile else 3, cols)).float()
    expected = x.double() @ dequantize_int8(q, scales, group_size).double().T
    product = cpu_gemv.int8_matmul if tile else cpu_gemv.int8_group_gemv
    assert torch.equal(product(x, q, scales, group_size).double(), expected)


@needs_cpp
def test_int8_tile_kernel_scales_each_rows_sums(avx512):
    """Scales per row multiply each output of the tile kernel exactly (small numbers), 50 rows by 21 outputs."""
    register_cpu_ops()
    out_features, cols = 21, 160
    q = every_int8_value(out_features, cols)
    scales = torch.arange(1, 1 + out_features, dtype=torch.float32) / 8
    x = torch.randint(-3, 4, (50, cols)).float()
    expected = x.double() @ dequantize_int8(q, scales).double().T
    assert torch.equal(cpu_gemv.int8_matmul(x, q, scales, None).double(), expected)


@needs_cpp
@pytest.mark.parametrize("group_size", [None, 32], ids=["per-row", "g32"])
def test_a_quantized_table_looks_up_and_projects_the_same_tensors(group_size):
    """A tied table quantized in place: the lookup gives each token's dequantized row exactly, the output
    projection (``cpp``) the product with the same weights."""
    register_cpu_ops()
    torch.manual_seed(0)
    vocab, dim = 300, 128
    q, scales = quantize_int8(torch.randn(vocab, dim), torch.float32, group_size)
    table = Int8Embedding(vocab, dim, EmbeddingQuant("int8", group_size))
    table.load_state_dict({"weight": q, "scales": scales}, assign=True)
    table.prepare("cpp")
    assert table.kernel == "cpp"
    dequantized = dequantize_int8(q, scales, group_size)
    ids = torch.tensor([[5, 299, 0], [17, 5, 123]])
    assert torch.equal(table(ids), dequantized[ids])
    x = torch.randn(2, 1, dim)
    assert relative_error(table.project(x), x.double() @ dequantized.double().T) < TOLERANCE


@needs_cpp
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_many_rows_take_the_dequantized_product(kind, monkeypatch):
    """A long prefill (more rows than :data:`CPP_MATMUL_ROWS`) dequantizes (int4: with our C++ code) and calls
    F.linear, on the same weights."""
    register_cpu_ops()
    layer, dequantized = int8_layer(48, 192) if kind == "int8" else int4_layer(48, 192, 64)
    layer.prepare("cpp")
    for name in ("int8_gemv", "int4_gemv", "int8_matmul", "int4_matmul"):
        monkeypatch.setattr(cpu_gemv, name, lambda *args: pytest.fail("the kernel took too many rows"))
    x = torch.randn(CPP_MATMUL_ROWS + 5, 192)
    assert relative_error(layer(x), x.double() @ dequantized.T) < TOLERANCE


@needs_cpp
def test_layers_the_kernels_do_not_take_dequantize():
    """int8 inputs not a multiple of 16, int4 inputs not a multiple of 64, int8 groups that do not divide the
    inputs (80 columns in groups of 32: a shorter last group), or bfloat16 scales (a bfloat16 model): ``cpp``
    means ``dequant`` for that layer, whose products are still right."""
    register_cpu_ops()
    cases = [int8_layer(24, 200), int8_layer(24, 192, torch.bfloat16), int4_layer(24, 200, 32)]
    cases.append(int4_layer(24, 192, 64, torch.bfloat16))
    cases += [int8_group_layer(24, 80, 32), int8_group_layer(24, 192, 64, torch.bfloat16)]
    for layer, dequantized in cases:
        layer.prepare("cpp")
        assert layer.kernel == "dequant"
        x = torch.randn(1, layer.in_features, dtype=layer.scales.dtype)
        assert relative_error(layer(x), x.double() @ dequantized.T) < 1e-2


def test_kernel_choice_on_the_cpu(monkeypatch):
    """``auto`` takes our C++ kernels where they can be built and run, else PyTorch's own; asking for them where
    they cannot be is an error that says why."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_gemv, "cpu_kernels_usable", lambda: False)
    assert resolve_kernel("auto", cpu) == "aten"
    with pytest.raises(ValueError, match="the cpp quantized kernels need an x86 CPU with AVX2, a C\\+\\+ compiler"):
        resolve_kernel("cpp", cpu)
    with pytest.raises(ValueError, match="the cpp quantized kernels need"):
        resolve_kernel("cpp", torch.device("cuda"))


@needs_cpp
def test_auto_takes_the_cpp_kernels_on_this_cpu():
    assert resolve_kernel("auto", torch.device("cpu")) == "cpp"


TABLE_G32 = QuantConfig("int4", 32, embeddings=EmbeddingQuant("int8", 32))


def counted(product, calls: list[str]):
    """``product``, noting its name in ``calls`` at each call."""

    def run(*args):
        calls.append(product.__name__)
        return product(*args)

    return run


@needs_cpp
@pytest.mark.parametrize("kernel", ["cpp", "cpp-q8"])
@pytest.mark.parametrize(
    "quant", [QuantConfig("int8"), QuantConfig("int4", 32), TABLE_G32], ids=["int8", "int4", "int4-table-int8-g32"]
)
def test_greedy_tokens_match_the_dequantizing_kernel(quant, kernel, monkeypatch):
    """A model every product of which the kernels take (inputs multiples of 64) decodes the same greedy tokens with
    ``cpp`` (and this tiny one with ``cpp-q8``) as with ``dequant``, eager and compiled
    (the operators' output shapes registered for inductor); with a quantized table, a tied model whose lookup and
    output projection read it. The prompt's 20 rows take the tile kernels (``cpp-q8``: its kernels of any rows, on
    the packed weights), each step's one row the few-rows ones."""
    tied = quant.embeddings is not None
    shape = dataclasses.replace(get_shape("tiny"), intermediate_size=192, tie_embeddings=tied)
    state = quantize_state(random_weights(shape, torch.float32, seed=1), shape, quant, torch.float32)
    greedy = SamplingConfig(temperature=0)

    def tokens(kernel, compile_mode):
        torch._dynamo.reset()
        options = EngineOptions(compile=compile_mode, device="cpu", kernels=KernelOptions(quant=kernel))
        engine = Engine.from_state(shape, state, options, quant)
        layers = [m for m in engine.model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
        assert layers and all(m.kernel == kernel for m in layers)
        assert isinstance(engine.model.tok_embeddings, Int8Embedding) == tied
        return engine.generate_ids(list(range(1, 21)), 24, greedy).tokens

    reference = tokens("dequant", "none")
    tiles: list[str] = []
    for name in ("int8_q8_gemv", "int4_q8_gemv") if kernel == "cpp-q8" else ("int8_matmul", "int4_matmul"):
        monkeypatch.setattr(cpu_gemv, name, counted(getattr(cpu_gemv, name), tiles))
    assert tokens(kernel, "none") == reference
    assert tiles, "the prompt did not take the tile kernels"
    assert tokens(kernel, "default") == reference


def test_a_lock_left_by_an_interrupted_build_is_removed_and_a_live_ones_kept(tmp_path, capsys):
    """torch's extension builder waits without end for a build's lock: one left by a build that was killed would
    hang every later load."""
    lock = tmp_path / "lock"
    lock.touch()
    cpu_gemv.clear_stale_lock(tmp_path)  # a build holding it now
    assert lock.exists() and capsys.readouterr().err == ""
    then = time.time() - cpu_gemv.STALE_LOCK_SECONDS - 1
    os.utime(lock, (then, then))
    cpu_gemv.clear_stale_lock(tmp_path)
    assert not lock.exists() and "did not finish" in capsys.readouterr().err
    cpu_gemv.clear_stale_lock(tmp_path)  # no lock: nothing to do
