"""The prefill's matrix product with quantized words (gpt_fast/kernels/triton_matmul.py): the activations' column
order against the words' layout in PyTorch, the kernel in Triton's interpreter against a float64 product, and
the kernel compiled for an H200 in each of its tiles."""

import json
import textwrap

import pytest
import torch

from gpt_fast.quant.products import group_columns, group_interleave, int8_interleave, interleave_columns
from gpt_fast.quant.schemes import quantize_int4, quantize_int8, unpack_int4
from tests.interpreter import interpret, needs_triton, old_numpy


@pytest.mark.parametrize("cols, group_size", [(256, 32), (200, 64), (384, 128), (512, 256)])
def test_group_columns_meet_the_nibbles_of_the_words_as_they_lie(cols, group_size):
    """Each activation column, put in the words' order (padded to whole groups), meets the nibble of its own
    column: the product with the words' nibbles read in memory order is the product with the levels."""
    torch.manual_seed(cols)
    q, _, _ = quantize_int4(torch.randn(6, cols), group_size, torch.float32)
    x = torch.randn(3, cols, dtype=torch.float64)
    nibbles = unpack_int4(group_interleave(q, group_size).view(torch.uint8))  # [6, G * group]: memory order
    got = group_columns(x, group_size) @ nibbles.double().T
    torch.testing.assert_close(got, x @ unpack_int4(q).double().T)


def test_interleaved_columns_meet_the_bytes_of_the_int8_words_as_they_lie():
    torch.manual_seed(2)
    q, _ = quantize_int8(torch.randn(5, 192), torch.float32)
    x = torch.randn(3, 192, dtype=torch.float64)
    offset = int8_interleave(q).view(torch.uint8).double() - 128  # [5, 192]: memory order
    torch.testing.assert_close(interleave_columns(x) @ offset.T, x @ q.double().T)


MATMUL_CHECK = """
import json, torch
from gpt_fast.kernels import triton_matmul
from gpt_fast.quant.products import group_columns, group_interleave, int8_interleave, interleave_columns
from gpt_fast.quant.schemes import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
worst = {}
for m, n, k, group in [(20, 48, 256, 32), (5, 40, 200, 64), (33, 24, 384, 128), (17, 16, 512, 256)]:
    g = torch.Generator().manual_seed(m * n)
    w = torch.randn(n, k, generator=g) / k**0.5
    x = torch.randn(m, k, generator=g).half()
    q, s, z = quantize_int4(w, group, torch.float16)
    exact = x.double() @ dequantize_int4(q, s, z, group).double().T
    tiles = [None, triton_matmul.Tile(16, 16, max(64, group), 1, 1), triton_matmul.Tile(32, 32, 2 * group, 1, 1)]
    for tile in tiles:
        got = triton_matmul.words_matmul(group_columns(x, group), group_interleave(q, group), s, z, group, tile)
        assert got.shape == (m, n) and got.dtype == torch.float16
        worst["int4"] = max(worst.get("int4", 0), ((got.double() - exact).norm() / exact.norm()).item())
    if k % 64 == 0:
        q8, s8 = quantize_int8(w, torch.float16)
        exact = x.double() @ dequantize_int8(q8, s8).double().T
        for tile in tiles:
            got = triton_matmul.words_matmul(interleave_columns(x), int8_interleave(q8), s8, None, 0, tile)
            worst["int8"] = max(worst.get("int8", 0), ((got.double() - exact).norm() / exact.norm()).item())
print(json.dumps(worst))
"""


@needs_triton
@old_numpy
def test_the_matmul_in_the_interpreter_matches_a_float64_product():
    """int4 (groups of 32 to 256, a ragged last group) and int8 words, rows that fill no tile, several tiles, in
    Triton's interpreter (a process of its own: TRITON_INTERPRET is read when the kernels are defined), within
    float16's rounding of the output. Float16 only: the interpreter's ``tl.dot`` of bfloat16 operands returns
    garbage (Triton 3.6); bfloat16 is checked on the GPU (tests/test_quant_gpu.py)."""
    worst = json.loads(interpret("-c", textwrap.dedent(MATMUL_CHECK)))
    assert worst["int4"] < 2e-3 and worst["int8"] < 2e-3, worst


ROWS_CHECK = """
import json, torch
from gpt_fast.kernels import triton_matmul
from gpt_fast.quant.products import group_interleave, int4_dequantize
from gpt_fast.quant.schemes import dequantize_int4, quantize_int4
worst, exact_weights = 0.0, True
for m, n, k, group in [(20, 48, 256, 32), (5, 70, 200, 64), (33, 24, 384, 128), (17, 16, 512, 256)]:
    g = torch.Generator().manual_seed(m * n)
    q, s, z = quantize_int4(torch.randn(n, k, generator=g) / k**0.5, group, torch.float16)
    x, words = torch.randn(m, k, generator=g).half(), group_interleave(q, group)
    exact = x.double() @ dequantize_int4(q, s, z, group).double().T
    for tile in [None, triton_matmul.RowsTile(16, 16, 1, 1, 1), triton_matmul.RowsTile(32, 16, 3, 1, 2)]:
        got = triton_matmul.int4_rows(x, words, s, z, group, tile)
        assert got.shape == (m, n) and got.dtype == torch.float16
        worst = max(worst, ((got.double() - exact).norm() / exact.norm()).item())
    eye = torch.eye(k).half()
    weights = torch.cat([triton_matmul.int4_rows(eye[i : i + 64], words, s, z, group) for i in range(0, k, 64)])
    exact_weights &= torch.equal(weights.T, int4_dequantize(q, s, z, group))
print(json.dumps({"worst": worst, "exact_weights": exact_weights}))
"""


@needs_triton
@old_numpy
def test_the_rows_product_in_the_interpreter_matches_a_float64_product():
    """:func:`gpt_fast.kernels.triton_matmul.int4_rows` (a batched decode step's rows, the words as the tensor
    cores' first operand) in Triton's interpreter: rows that fill no tile, ragged last groups, splits along the
    columns, within float16's rounding of the output; and one-hot rows that read back every weight exactly as the
    dequantization gives it (float16: Triton's widening; bfloat16's PTX pairs are checked on the GPU)."""
    got = json.loads(interpret("-c", textwrap.dedent(ROWS_CHECK)))
    assert got["worst"] < 2e-3 and got["exact_weights"], got


@needs_triton
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "rows, n, group", [(64, 4096, 0), (300, 4096, 0), (16, 4096, 128), (64, 22016, 128), (300, 22016, 256)]
)
def test_the_matmul_compiles_for_an_h200_in_each_tile(dtype, rows, n, group):
    """Triton's front end and ptxas accept the kernel for an H200 without a GPU, in the tiles :func:`tile_for`
    gives few and many rows of int8 and int4 products, specialized as a launch specializes aligned tensors and
    dimensions divisible by 16 (its pipelined loads), within an H200's shared memory per block (227 KiB: a launch
    asking more fails)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpt_fast.kernels.triton_matmul import _words_matmul, tile_for

    tile = tile_for(rows, n, group)
    pointers = {"x_ptr": dtype, "w_ptr": "i32", "s_ptr": dtype, "z_ptr": dtype, "y_ptr": dtype}
    constants = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k}
    constants |= {"VALUES": 8 if group else 4, "GROUP": group}
    names = _words_matmul.arg_names
    signature = {p: "constexpr" if p in constants else "*" + pointers[p] if p in pointers else "i32" for p in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(names) if p not in constants and p != "M"}
    constexprs = {(names.index(p),): v for p, v in constants.items()}
    source = ASTSource(_words_matmul, signature, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": tile.warps, "num_stages": tile.stages}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert "cubin" in compiled.asm
    assert compiled.metadata.shared <= 227 * 1024


@needs_triton
@pytest.mark.parametrize("dtype, ptx", [("bf16", True), ("bf16", False), ("fp16", False)])
@pytest.mark.parametrize("rows, n", [(16, 4096), (64, 22016)])
def test_the_rows_product_compiles_for_an_h200(dtype, ptx, rows, n):
    """Triton's front end and ptxas accept :func:`int4_rows`' kernel for an H200 without a GPU, with the levels
    widened by PTX's bfloat16 pairs or in Triton, in the tile :func:`rows_tile_for` gives."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpt_fast.kernels.triton_matmul import _int4_rows, rows_tile_for

    tile = rows_tile_for(rows, n)
    pointers = {"x_ptr": dtype, "w_ptr": "i32", "s_ptr": dtype, "z_ptr": dtype, "y_ptr": "fp32"}
    constants = {"BLOCK_N": tile.block_n, "WORDS": tile.words, "GROUP": 128, "ROWS": rows}
    constants |= {"SPLITS": tile.splits, "STAGES": tile.stages, "PTX": ptx}
    names = _int4_rows.arg_names
    signature = {p: "constexpr" if p in constants else "*" + pointers[p] if p in pointers else "i32" for p in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(names) if p not in constants and p != "M"}
    constexprs = {(names.index(p),): v for p, v in constants.items()}
    source = ASTSource(_int4_rows, signature, constexprs=constexprs, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": tile.warps})
    assert "cubin" in compiled.asm
    assert ("fma.rn.bf16x2" in compiled.asm["ptx"]) == ptx
