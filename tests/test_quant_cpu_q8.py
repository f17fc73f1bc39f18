"""The ``cpp-q8`` kernels (:func:`gpt_fast.kernels.cpu_gemv.int8_q8_gemv` and ``int4_q8_gemv``, on the weights
packed by ``pack_int8_q8`` and ``pack_int4_q8``), whose activations are rounded to int8 per block of 32 columns:
against a float64 product of a PyTorch reference of that rounding, to float32's precision; against the product of
the activations themselves, within the rounding's error; exactly, where the rounding is exact; the layers' and
``auto``'s choice (greedy decoding: tests/test_quant_cpu_kernels.py)."""

import pytest
import torch

from gpt_fast.kernels import cpu_gemv
from gpt_fast.model.config import EmbeddingQuant, QuantConfig
from gpt_fast.quant.layers import Int4Linear, Int8Embedding, Int8Linear
from gpt_fast.quant.products import register_cpu_ops, resolve_kernel
from gpt_fast.quant.schemes import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8, unpack_int4

# Relative error ||ours - reference|| / ||reference|| against the float64 product of the rounded activations: the
# kernels' integer sums are exact and their float32 sums over blocks land near 1e-7.
TOLERANCE = 1e-5
# The same against the product of the activations as they are: a block's levels are max |x| / 127 apart, so each
# column is off by at most max |x| / 254; on random normal rows the products land near 5e-3.
ROUNDING_TOLERANCE = 2e-2


@pytest.fixture(params=[True, False], ids=["vnni", "avx2"])
def q8(request):
    """The kernels with AVX512-VNNI's instructions where this CPU has them (else skipped), and with AVX2's, as on a
    CPU without AVX-512; skip where the kernels cannot run."""
    if not cpu_gemv.cpu_kernels_usable():
        pytest.skip("needs an x86 CPU with AVX2, a C++ compiler, ninja")
    register_cpu_ops()
    torch.ops.gpt_fast.set_avx512(request.param)
    if cpu_gemv.q8_vnni() != request.param:
        torch.ops.gpt_fast.set_avx512(True)
        pytest.skip("needs a CPU with AVX512-VNNI")
    yield
    torch.ops.gpt_fast.set_avx512(True)  # the default: the AVX-512 code wherever the CPU has it


def relative_error(got, expected):
    return ((got.double() - expected).norm() / expected.norm()).item()


def rounded(x):
    """``x`` [..., K] as the kernels multiply it: each block of 32 columns as int8 levels (``x * 127 / max |x|``
    rounded to the nearest, ties to even) times its scale (``max |x| / 127``, in float32), in float64."""
    blocks = x.reshape(*x.shape[:-1], -1, cpu_gemv.Q8_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    levels = torch.where(amax > 0, (blocks * (127 / amax)).round(), torch.zeros_like(blocks))
    return (levels.double() * (amax / 127).double()).reshape(x.shape)


def int4_reference(x, q, scales, zeros, group_size):
    """The int4 kernel's product in float64: the centered levels (``(q - 8) * scale``) times the rounded
    activations, the zero points times the activations as they are."""
    cols = x.shape[-1]
    s, z = (t.double().repeat_interleave(group_size, dim=1)[:, :cols] for t in (scales, zeros))  # [N, K]
    return rounded(x) @ ((unpack_int4(q).double() - 8) * s).T + x.double() @ z.T


def int8_q8(x, q, scales, group_size):
    """The int8 kernel's product of ``x`` with ``q`` and ``scales``, packed first."""
    return cpu_gemv.int8_q8_gemv(x, *cpu_gemv.pack_int8_q8(q, scales), group_size)


@pytest.mark.parametrize("rows", [1, 5, 16, 35])
@pytest.mark.parametrize("out_features, cols", [(96, 160), (48, 576), (16, 1536), (32, 96)])
def test_int8_kernel_matches_the_rounded_product(q8, rows, out_features, cols):
    """Scales per row; 160 and 96 columns are an odd number of blocks (the last on its own)."""
    torch.manual_seed(rows)
    q, scales = quantize_int8(torch.randn(out_features, cols), torch.float32)
    x = torch.randn(rows, cols)
    weights = dequantize_int8(q, scales).double()
    got = int8_q8(x, q, scales, None)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert relative_error(got, rounded(x) @ weights.T) < TOLERANCE
    assert relative_error(got, x.double() @ weights.T) < ROUNDING_TOLERANCE


@pytest.mark.parametrize("rows", [1, 4, 35])
@pytest.mark.parametrize("out_features, cols, group_size", [(96, 576, 32), (48, 256, 64), (16, 512, 128)])
def test_grouped_int8_kernel_matches_the_rounded_product(q8, rows, out_features, cols, group_size):
    torch.manual_seed(rows)
    q, scales = quantize_int8(torch.randn(out_features, cols), torch.float32, group_size)
    x = torch.randn(rows, cols)
    weights = dequantize_int8(q, scales, group_size).double()
    got = int8_q8(x, q, scales, group_size)
    assert relative_error(got, rounded(x) @ weights.T) < TOLERANCE
    assert relative_error(got, x.double() @ weights.T) < ROUNDING_TOLERANCE


@pytest.mark.parametrize("rows", [1, 3, 4, 35])
@pytest.mark.parametrize(
    "out_features, cols, group_size",
    [(96, 576, 32), (48, 192, 64), (32, 576, 128), (16, 1536, 256)],
    ids=["g32", "g64-odd-chunks", "g128-short-last-group", "g256"],
)
def test_int4_kernel_matches_the_rounded_product(q8, rows, out_features, cols, group_size):
    """Every row count: 4 rows at a time, then the rest (35 = 8 x 4 + 3)."""
    torch.manual_seed(rows)
    q, scales, zeros = quantize_int4(torch.randn(out_features, cols), group_size, torch.float32)
    x = torch.randn(rows, cols)
    got = cpu_gemv.int4_q8_gemv(x, *cpu_gemv.pack_int4_q8(q, scales, zeros), group_size)
    assert got.shape == (rows, out_features)
    assert relative_error(got, int4_reference(x, q, scales, zeros, group_size)) < TOLERANCE
    exact = x.double() @ dequantize_int4(q, scales, zeros, group_size).double().T
    assert relative_error(got, exact) < ROUNDING_TOLERANCE


def exact_rows(rows, cols):
    """Activations the rounding keeps exactly: integers whose largest magnitude in every block is 127."""
    x = torch.randint(-127, 128, (rows, cols)).float()
    x[:, :: cpu_gemv.Q8_BLOCK] = 127.0
    return x


def test_int8_kernel_reads_every_value_and_each_groups_scale(q8):
    """Weights of every value -128..127 at every column position, scales that differ per group and row, activations
    the rounding keeps: each byte, each block and each group's scale land where the scheme says (float64 exact)."""
    out_features, cols, group_size = 16, 256, 64
    q = ((torch.arange(out_features)[:, None] * 31 + torch.arange(cols)[None, :] * 7) % 256 - 128).to(torch.int8)
    scales = torch.arange(1, 1 + out_features * 4, dtype=torch.float32).reshape(out_features, 4) / 4
    x = exact_rows(3, cols)
    expected = x.double() @ dequantize_int8(q, scales, group_size).double().T
    assert torch.equal(int8_q8(x, q, scales, group_size).double(), expected)
    row_scales = scales[:, 0].contiguous()
    expected = x.double() @ dequantize_int8(q, row_scales).double().T
    assert torch.equal(int8_q8(x, q, row_scales, None).double(), expected)


def test_int4_kernel_reads_every_level_and_a_zero_of_its_own_per_group(q8):
    """As the float kernel's test: every level 0..15 at every column position, scales and zeros per group and row,
    activations the rounding keeps (float64 exact)."""
    out_features, cols, group_size = 16, 128, 32
    levels = (torch.arange(out_features)[:, None] + torch.arange(cols)[None, :] * 7) % 16  # [N, K]
    packed = (levels[:, 0::2] | (levels[:, 1::2] << 4)).to(torch.uint8)
    assert torch.equal(unpack_int4(packed), levels.to(torch.uint8))
    scales = torch.arange(1, 1 + out_features * 4, dtype=torch.float32).reshape(out_features, 4) / 4
    zeros = -torch.arange(out_features * 4, dtype=torch.float32).reshape(out_features, 4)
    x = exact_rows(2, cols)
    expected = x.double() @ dequantize_int4(packed, scales, zeros, group_size).double().T
    words = cpu_gemv.pack_int4_q8(packed, scales, zeros)
    assert torch.equal(cpu_gemv.int4_q8_gemv(x, *words, group_size).double(), expected)


def test_blocks_of_zeros_and_a_lone_large_value(q8):
    """A block of zeros has no scale to divide by (its levels are 0); one large value in a block takes its whole
    range, and the block's small values round to 0 there, as the reference rounds them."""
    torch.manual_seed(0)
    q, scales = quantize_int8(torch.randn(32, 128), torch.float32)
    x = torch.randn(2, 128)
    x[0, 32:64] = 0.0
    x[1, 64] = 1e4
    got = int8_q8(x, q, scales, None)
    assert relative_error(got, rounded(x) @ dequantize_int8(q, scales).double().T) < TOLERANCE


def layer_int8(cols, group_size=None, out_features=32):
    torch.manual_seed(0)
    q, scales = quantize_int8(torch.randn(out_features, cols), torch.float32, group_size)
    quant = QuantConfig("int8") if group_size is None else EmbeddingQuant("int8", group_size)
    layer = Int8Linear(cols, out_features, quant, bias=False)
    layer.load_state_dict({"weight": q, "scales": scales}, assign=True)
    return layer, dequantize_int8(q, scales, group_size).double()


def test_layers_take_the_kernels_where_their_blocks_fit(q8):
    """int8 inputs a multiple of 32 and groups a power of two from 32 take ``cpp-q8``; 80 inputs (a multiple of
    16 only) take ``cpp``, groups that do not divide the inputs ``dequant``. Layers of a multiple of 16 outputs
    take ``cpp-q8`` on their packed weights, which replace theirs, for any number of rows (a prompt's too);
    others ``cpp``."""
    for cols, group_size, kernel in [
        (96, None, "cpp-q8"),
        (256, 64, "cpp-q8"),
        (80, None, "cpp"),
        (192, 128, "dequant"),
    ]:
        layer, _ = layer_int8(cols, group_size)
        layer.prepare("cpp-q8")
        assert layer.kernel == kernel, (cols, group_size)
    x = torch.randn(35, 192)
    for out_features, kernel in [(32, "cpp-q8"), (24, "cpp")]:
        torch.manual_seed(0)
        q, scales, zeros = quantize_int4(torch.randn(out_features, 192), 64, torch.float32)
        int4 = Int4Linear(192, out_features, QuantConfig("int4", 64), bias=False)
        int4.load_state_dict({"weight": q, "scales": scales, "zeros": zeros}, assign=True)
        int4.prepare("cpp-q8")
        layer, dequantized = layer_int8(192, out_features=out_features)
        layer.prepare("cpp-q8")
        for prepared, reference in [(int4, dequantize_int4(q, scales, zeros, 64).double()), (layer, dequantized)]:
            assert prepared.kernel == kernel
            assert (prepared.weight is None) == (kernel == "cpp-q8")  # packed into words, which replace it
            tolerance = ROUNDING_TOLERANCE if kernel == "cpp-q8" else 1e-5
            assert relative_error(prepared(x), x.double() @ reference.T) < tolerance


def test_a_packed_table_looks_up_its_rows(q8):
    """A table packed for ``cpp-q8`` (scales per row or per group) gives the rows of its checkpoint's weights."""
    for group_size in (None, 32):
        torch.manual_seed(0)
        q, scales = quantize_int8(torch.randn(48, 64), torch.float32, group_size)
        table = Int8Embedding(48, 64, EmbeddingQuant("int8", group_size))
        table.load_state_dict({"weight": q, "scales": scales}, assign=True)
        table.prepare("cpp-q8")
        assert table.kernel == "cpp-q8" and table.weight is None
        idx = torch.tensor([[0, 17], [47, 31]])
        torch.testing.assert_close(table(idx), dequantize_int8(q, scales, group_size)[idx])


def test_extreme_levels_do_not_saturate(q8):
    """The largest sums each instruction set adds: int8 weights -128 and 127 against levels of 127 of either sign
    (AVX2's 16-bit pairs reach 2 * 128 * 127), and int4 levels 15 against them (8 pairs of 2 * 15 * 127 in 16 bits):
    float64 exact."""
    cols = 64
    x = torch.full((2, cols), 127.0)
    x[1] = -127.0
    for value in (-128, 127):
        q = torch.full((16, cols), value, dtype=torch.int8)
        scales = torch.ones(16)
        expected = x.double() @ dequantize_int8(q, scales).double().T
        assert torch.equal(int8_q8(x, q, scales, None).double(), expected), value
    levels = torch.full((16, cols // 2), 0xFF, dtype=torch.uint8)  # every level 15
    scales, zeros = torch.ones(16, cols // 32), torch.zeros(16, cols // 32)
    expected = x.double() @ dequantize_int4(levels, scales, zeros, 32).double().T
    got = cpu_gemv.int4_q8_gemv(x, *cpu_gemv.pack_int4_q8(levels, scales, zeros), 32)
    assert torch.equal(got.double(), expected)


def test_kernel_choice():
    """``auto`` keeps ``cpp``, whose greedy tokens are the float model's (the default model's int4 form picks
    another token with ``cpp-q8`` within 24 of one of its test prompts); ``cpp-q8`` runs wherever ``cpp`` does."""
    if not cpu_gemv.cpu_kernels_usable():
        pytest.skip("needs an AVX2 CPU, a C++ compiler, ninja")
    cpu = torch.device("cpu")
    assert resolve_kernel("auto", cpu) == "cpp"
    assert resolve_kernel("cpp-q8", cpu) == "cpp-q8"
