"""Our CPU kernels' own helper threads (``gpt_fast/kernels/cpu_threads.cpp``): products and attentions large enough to
take a second thread give the numbers they give on one thread (each output row is computed by one thread, in the same
order), and those match the float64 reference, call after call, from two Python threads at once, and in a forked
child, which has none of the parent's helper threads: the caller never waits for a helper that has not started.
The helper count follows torch's thread count, which tests/conftest.py restores after each test."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from decode_attention_reference import kernel_errors
from test_decode_attention import cpp_kernel
from test_quant_cpu_kernels import int4_layer, relative_error

from gpt_fast.kernels import cpu_gemv
from gpt_fast.quant.products import int8_linear, register_cpu_ops
from gpt_fast.quant.schemes import dequantize_int8, quantize_int8

needs_cpp = pytest.mark.skipif(not cpu_gemv.cpu_kernels_usable(), reason="our C++ kernels do not build here")

# 4 MB of int8 weights, 2 MB of int4: each product takes two threads (a thread per megabyte it reads)
OUT_FEATURES, COLUMNS = 4096, 1024
TOLERANCE = 1e-5  # float32 sums against the float64 product, as in test_quant_cpu_kernels.py


def int8_product(out_features: int = OUT_FEATURES) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    q, scales = quantize_int8(torch.randn(out_features, COLUMNS), torch.float32)
    return lambda x: int8_linear(x, q, scales, "cpp"), dequantize_int8(q, scales).double()


def int4_product(out_features: int = OUT_FEATURES) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    layer, weights = int4_layer(out_features, COLUMNS, 32)
    layer.prepare("cpp")
    return lambda x: layer(x), weights


PRODUCTS = {"int8": int8_product, "int4 g32": int4_product}


def inputs(count: int, rows: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(count)
    return [torch.randn(1, rows, COLUMNS, generator=generator) for _ in range(count)]


@needs_cpp
@pytest.mark.parametrize("kind", PRODUCTS)
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("out_features", [OUT_FEATURES, OUT_FEATURES + 53])  # the last task's last rows: a part
def test_two_threads_give_one_threads_numbers_call_after_call(kind, rows, out_features):
    """Each thread takes whole tasks of 16-row grains, and the last task ends where the rows do."""
    register_cpu_ops()
    product, weights = PRODUCTS[kind](out_features)
    xs = inputs(8, rows)
    torch.set_num_threads(1)
    alone = [product(x) for x in xs]
    for x, out in zip(xs, alone, strict=True):
        assert relative_error(out, x.double() @ weights.T) < TOLERANCE
    torch.set_num_threads(2)
    for _ in range(25):
        for x, out in zip(xs, alone, strict=True):
            assert torch.equal(product(x), out)


@needs_cpp
def test_two_python_threads_call_the_kernels_at_once():
    """One caller's job at a time takes the helpers; a second caller meanwhile runs its tasks on its own thread."""
    register_cpu_ops()
    product, _ = int8_product()
    xs = inputs(16)
    torch.set_num_threads(1)
    alone = [product(x) for x in xs]
    torch.set_num_threads(2)

    def run(offset: int) -> bool:
        return all(torch.equal(product(xs[(i + offset) % 16]), alone[(i + offset) % 16]) for i in range(200))

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(run, (0, 8)))


def product_in_child(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, queue) -> None:
    """Only our operator runs here: torch's own OpenMP threads do not survive a fork either, and a torch operator
    that takes them would wait for them forever."""
    torch.set_num_threads(2)
    queue.put(product(x).tolist())  # a tensor would be sent as a file descriptor the exiting child closes


@needs_cpp
def test_a_forked_child_computes_without_the_parents_helpers():
    """The parent has started its helper; the forked child has none, so its caller takes every task itself."""
    register_cpu_ops()
    product, _ = int8_product()
    (x,) = inputs(1)
    torch.set_num_threads(2)
    expected = product(x)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=product_in_child, args=(product, x, queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0 and torch.equal(torch.tensor(got), expected)


@needs_cpp
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 2**-9)])
def test_the_attention_on_two_threads_matches_the_pytorch_code(dtype, tolerance):
    """The decode attention shares its rows' kv heads among the threads: the reference's cases (batches of 1 to 4
    rows, MHA to MQA) against the model's code, as tests/test_decode_attention.py checks them on one thread."""
    torch.set_num_threads(2)
    output_error, cache_error = kernel_errors(cpp_kernel, dtype, "cpu")
    assert output_error < tolerance and cache_error == 0.0
