"""The choice of the decode attention kernel, and the fused Triton kernel in Triton's interpreter against the model's
PyTorch code, where Triton is installed (tests/decode_attention_reference.py)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from decode_attention_reference import (
    decoded_logits,
    kernel_errors,
    model_configs,
    model_errors,
    paged_kernel_errors,
    random_model,
    reference_attention,
    step_inputs,
)

from gpt_fast.accel.decode_attention import (
    attention_pdl,
    fused_decode_attention,
    fused_decode_attention_pdl,
    register_cpp_ops,
    resolve_attention_kernel,
    use_attention_kernel,
)
from gpt_fast.accel.options import KernelOptions
from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.kernels import cpu_attention, cpu_gemv
from gpt_fast.model.shapes import get_shape
from tests.interpreter import interpret_all, needs_triton, old_numpy

REFERENCE = Path(__file__).resolve().parent / "decode_attention_reference.py"


TINY = get_shape("tiny")


def test_kernel_choice_on_the_cpu():
    """``auto`` takes the C++ kernel in compiled steps where it builds, never in eager ones or with regional
    compilation; ``cpp`` is refused where it cannot run."""
    cpu = torch.device("cpu")
    cpp = "cpp" if cpu_gemv.cpu_kernels_usable() else "torch"
    assert resolve_attention_kernel("auto", cpu, "reduce-overhead") == cpp
    assert resolve_attention_kernel("auto", cpu, "default") == cpp
    assert resolve_attention_kernel("auto", cpu, "none") == "torch"
    assert resolve_attention_kernel("auto", cpu, "default", regional_compile=True) == "torch"
    assert resolve_attention_kernel("torch", cpu, "none") == "torch"
    with pytest.raises(ValueError, match="the triton attention kernel needs a CUDA GPU with Triton installed, not cpu"):
        resolve_attention_kernel("triton", cpu, "none")
    with pytest.raises(ValueError, match="attention kernel 'flash' is not one of auto, triton, cpp, torch"):
        resolve_attention_kernel("flash", cpu, "none")
    with pytest.raises(ValueError, match="the cpp attention kernel needs an x86 CPU with AVX2, a C\\+\\+ compiler"):
        resolve_attention_kernel("cpp", torch.device("cuda"), "default")


def test_a_cache_in_a_dtype_of_its_own_takes_a_kernel_that_reads_it(monkeypatch, pretend_gpu):
    """The C++ kernel reads a float32 model's float16, bfloat16 or float8 cache, none below another model (``auto``
    takes the model's code, ``cpp`` asked for is refused); the Triton kernel reads any cache, so its choice does not
    depend on the cache's dtype."""
    from gpt_fast.accel import decode_attention

    cpu, f32, f16, bf16, f8 = torch.device("cpu"), torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn
    cpp = "cpp" if cpu_gemv.cpu_kernels_usable() else "torch"
    assert resolve_attention_kernel("auto", cpu, "default", cache_dtype=f16, dtype=f32) == cpp
    assert resolve_attention_kernel("auto", cpu, "default", cache_dtype=f32, dtype=bf16) == "torch"
    assert resolve_attention_kernel("auto", cpu, "default", cache_dtype=f8, dtype=f32) == cpp
    assert resolve_attention_kernel("auto", cpu, "default", cache_dtype=f8, dtype=bf16) == "torch"
    with pytest.raises(ValueError, match="the cpp attention kernel does not read a torch.float32 KV cache of a "):
        resolve_attention_kernel("cpp", cpu, "default", cache_dtype=f32, dtype=bf16)
    with pytest.raises(ValueError, match="the cpp attention kernel does not read a torch.float8_e4m3fn KV cache"):
        resolve_attention_kernel("cpp", cpu, "default", cache_dtype=f8, dtype=bf16)
    gpu = pretend_gpu(9)
    monkeypatch.setattr(decode_attention, "register_triton_ops", lambda: None)
    for cache_dtype in (None, f8, f16):
        assert resolve_attention_kernel("auto", gpu, "reduce-overhead", cache_dtype=cache_dtype, dtype=bf16) == "triton"
        assert resolve_attention_kernel("triton", gpu, "default", cache_dtype=cache_dtype, dtype=bf16) == "triton"


needs_cpp = pytest.mark.skipif(not cpu_gemv.cpu_kernels_usable(), reason="our C++ kernels do not build here")


def cpp_kernel(*args: object, launch: object = None) -> torch.Tensor:
    """The C++ kernel as the reference's cases call a kernel (``launch`` is the Triton kernel's)."""
    register_cpp_ops()
    return cpu_attention.decode_attention(*args)


@needs_cpp
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 2**-9)])
def test_the_cpp_kernel_matches_the_pytorch_code(dtype, tolerance):
    """The reference's cases (MHA, GQA, MQA; head_dim 16 to 128; shared positions and each row's own, the first and
    the last; later cache rows; sliding windows; soft-capping), over a static cache and a paged one: the output
    against rotary embedding + the cache's update + ``attend_one_query``, and the cache after the write. The
    rotated key is rounded to the cache's dtype as the model's code rounds it, so the cache is equal; the output
    differs by the order of float32 sums, in bfloat16 by an output rounded the other way now and then (the
    tolerance is half its precision). The paged cache in both layouts (``PagedKVCache.heads_major``)."""
    for errors in (
        kernel_errors(cpp_kernel, dtype, "cpu"),
        paged_kernel_errors(cpp_kernel, dtype, "cpu"),
        paged_kernel_errors(cpp_kernel, dtype, "cpu", heads_major=True),
    ):
        assert errors[0] < tolerance and errors[1] == 0.0


@needs_cpp
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_the_cpp_kernel_reads_a_narrower_cache_as_the_pytorch_code_does(cache_dtype):
    """float32 queries over a float16, bfloat16 or float8 cache (``--kv_cache_dtype``): the key and value rounded
    to the cache as ``KVCache.update`` rounds them (the cache equal after the write; float8's clamped to ±448), the
    output within float32 sums' order of the model's code, which reads the narrower cache back as float32. Other
    mixes are refused."""
    for errors in (
        kernel_errors(cpp_kernel, torch.float32, "cpu", cache_dtype=cache_dtype),
        paged_kernel_errors(cpp_kernel, torch.float32, "cpu", cache_dtype=cache_dtype, heads_major=True),
    ):
        assert errors[0] < 1e-6 and errors[1] == 0.0
    (q, k, v, cos, sin, input_pos), _ = step_inputs(1, 4, 2, 16, 8, [3], torch.bfloat16, "cpu")
    kv = torch.zeros(2, 1, 2, 8, 16, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="decode_attention_cpu: kv"):
        cpp_kernel(q, k, v, cos, sin, kv, input_pos, 0, 0.25, None, None, None)


@needs_cpp
def test_the_cpp_kernel_writes_and_reads_every_float8_value_as_torch_converts_it():
    """A float8 cache's one position, written by the step and read back (its weight is 1): every finite e4m3fn
    value, subnormals and both zeros included, and values beyond ±448 (clamped, as ``KVCache.update`` clamps) or
    between float8's values (rounded to the nearest), come out as ``torch``'s conversions give them."""
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[~finite.isnan()]  # 254 values
    between = torch.tensor([1000.0, -1000.0, 460.0, 447.9, 1e-5, -3e-3, 0.3, -1.7e-2, 5.0, 1e-9])
    value = torch.cat([finite, between]).view(1, 1, 1, -1)  # [1, 1, 1, 264]
    dim = value.shape[-1]
    q, k = torch.randn(1, 1, 1, dim), torch.randn(1, 1, 1, dim)
    cos, sin = torch.ones(1, 1, dim // 2), torch.zeros(1, 1, dim // 2)
    kv = torch.zeros(2, 1, 1, 4, dim, dtype=torch.float8_e4m3fn)
    out = cpp_kernel(q, k, value, cos, sin, kv, torch.tensor([0]), 0, dim**-0.5, None, None, None)
    expected = value.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(kv[1, 0, 0, 0].view(torch.uint8), expected.flatten().view(torch.uint8))
    assert torch.equal(out, expected.float())


@needs_cpp
def test_tiny_models_decode_with_the_cpp_kernel_as_with_the_pytorch_code():
    """Plain Llama, GQA, q/k norms, Gemma 2's windows with soft-capping, Phi-3's head_dim 96; rows at their own
    positions, a paged cache: the logits of five decode steps."""
    assert model_errors(cpp_kernel) < 1e-5


def test_a_rocm_build_keeps_the_pytorch_code(monkeypatch):
    """On ROCm (and on a CUDA build without Triton) the GPU runs the model's own attention code."""
    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert resolve_attention_kernel("auto", gpu, "reduce-overhead") == "torch"
    with pytest.raises(ValueError, match="the triton attention kernel needs a CUDA GPU"):
        resolve_attention_kernel("triton", gpu, "reduce-overhead")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert resolve_attention_kernel("auto", gpu, "reduce-overhead") == "torch"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize(
    ("mode", "capability", "regional", "expected", "pdl"),
    [
        ("reduce-overhead", 9, False, "triton", True),  # CUDA graphs, PDL: where our GEMV is taken
        ("max-autotune", 9, False, "triton", True),
        ("default", 9, False, "torch", False),  # no CUDA graphs: no PDL
        ("reduce-overhead", 8, False, "torch", False),  # no PDL before compute capability 9
        ("reduce-overhead", 9, True, "torch", True),  # --regional_compile: no mutating operator in a region
    ],
)
def test_auto_takes_the_kernel_where_it_was_measured_faster(
    monkeypatch, pretend_gpu, mode, capability, regional, expected, pdl
):
    """``pdl``: whether the kernel, when chosen, is the operator launched with PDL."""
    from gpt_fast.accel import decode_attention

    gpu = pretend_gpu(capability)
    monkeypatch.setattr(decode_attention, "register_triton_ops", lambda: None)
    kernel = resolve_attention_kernel("auto", gpu, mode, regional_compile=regional)
    assert kernel == expected
    assert attention_pdl("triton", gpu, mode) == pdl


def test_engine_options_check_the_attention_kernel():
    with pytest.raises(ValueError, match="kernels.attention 'flash' is not one of auto, triton, cpp, torch"):
        EngineOptions(kernels=KernelOptions(attention="flash"))
    with pytest.raises(ValueError, match="the triton attention kernel needs a CUDA GPU"):
        Engine.from_state(get_shape("tiny"), {}, EngineOptions(device="cpu", kernels=KernelOptions(attention="triton")))
    with pytest.raises(ValueError, match="regional_compile does not combine with the triton attention kernel"):
        EngineOptions(compile="reduce-overhead", regional_compile=True, kernels=KernelOptions(attention="triton"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize(("shape", "programs"), [("smollm2-135m", 16), ("llama-3-8b", 16), ("llama-2-7b", 1)])
def test_a_decode_steps_short_cache_spreads_over_programs_where_kv_heads_are_few(shape, programs):
    """A 256-position cache: one loop step per program where the kv heads are few (each program waits for its
    loads once), and where they make programs enough, one split (no second kernel to combine splits) in one loop
    step of 8 warps."""
    from gpt_fast.kernels.triton_decode_attention import decode_launch

    config = get_shape(shape)
    launch = decode_launch(config.n_head // config.n_local_heads, config.head_dim, config.n_local_heads)
    assert -(-256 // launch.split_len) == programs
    assert launch.split_len == launch.block_s and launch.warps == (4 if programs > 1 else 8)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize(
    ("shape", "rows", "tile"),
    [
        ("llama-2-7b", 8, (1024, 128, False)),  # MHA: 256 (row, kv head) pairs, one split per row and kv head
        ("llama-2-7b", 4, None),
        ("llama-3-8b", 32, (1024, 64, True)),  # GQA: the tensor cores
        ("llama-3-8b", 8, (256, 128, True)),
        ("llama-3-8b", 4, None),
    ],
)
def test_a_step_of_many_rows_takes_a_tile_of_its_own(shape, rows, tile):
    """From 256 (row, kv head) pairs on, the rows alone make programs enough: each walks its row's positions in one
    split of up to 1024 over 4 warps; a GQA step of 16-bit caches from 64 pairs on takes the tensor cores (a float32
    cache keeps the reductions); fewer rows keep the one-row tile (``None``)."""
    from gpt_fast.kernels.triton_decode_attention import decode_launch

    config = get_shape(shape)
    group = (config.n_head // config.n_local_heads, config.head_dim, config.n_local_heads)
    launch = decode_launch(*group, rows)
    if tile is None:
        assert launch == decode_launch(*group)
        return
    assert (launch.split_len, launch.block_s, launch.dot, launch.warps) == (*tile, 4)
    assert not decode_launch(*group, rows, torch.float32).dot


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize(
    ("shape", "rows", "tile"),
    [
        ("llama-2-7b", 64, (1024, 64, 2, True, True, False)),  # MHA: 2048 pairs, the tensor cores, float16 operands
        ("llama-2-7b", 16, (1024, 64, 2, True, True, False)),  # 512 pairs: the tensor cores too
        ("llama-2-7b", 8, (1024, 128, 4, False, False, True)),  # 256 pairs: weighted values per position
        ("llama-3-8b", 32, (1024, 64, 4, True, True, False)),  # GQA: its tensor-core tiles, float16 operands
        ("llama-3-8b", 8, (256, 128, 4, True, True, False)),
    ],
)
def test_a_float8_caches_step_of_many_rows_takes_its_own_tile(shape, rows, tile):
    """A float8 cache's step, bound by the arithmetic: float16 operands on the tensor cores, MHA there too from 512
    (row, kv head) pairs, and from 256 with its weighted values summed once after the loop; one row keeps the
    one-row tile."""
    from gpt_fast.kernels.triton_decode_attention import decode_launch

    config = get_shape(shape)
    group = (config.n_head // config.n_local_heads, config.head_dim, config.n_local_heads)
    launch = decode_launch(*group, rows, torch.float8_e4m3fn)
    assert (launch.split_len, launch.block_s, launch.warps, launch.dot, launch.mma16, launch.acc_pos) == tile
    assert decode_launch(*group, 1, torch.float8_e4m3fn) == decode_launch(*group, 1)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize(("shape", "splits"), [("smollm2-135m", 128), ("llama-3-8b", 32), ("llama-2-7b", 16)])
def test_a_long_caches_splits_are_capped_per_kv_head(shape, splits):
    """An 8192-position cache (a server's) splits into at most ``splits`` per kv head, so that a row has a few
    hundred programs at most (uncapped, SmolLM2 would have 512 per kv head, each reading 16 positions)."""
    from gpt_fast.kernels.triton_decode_attention import SPLIT_PROGRAMS, decode_launch

    config = get_shape(shape)
    launch = decode_launch(config.n_head // config.n_local_heads, config.head_dim, config.n_local_heads)
    assert launch.max_splits == splits
    assert launch.max_splits * config.n_local_heads <= max(SPLIT_PROGRAMS, 16 * config.n_local_heads)


def test_every_attention_layer_gets_the_kernel_and_its_window():
    """Gemma 2's sliding layers see ``sliding_window`` positions, its full ones all; the engine on the CPU leaves the
    PyTorch code in place, and the kernel can be given and taken back."""
    from test_bench_decode import shrunk

    shape = shrunk("gemma-2-9b")  # a sliding layer, a full one, then the last (full)
    engine = Engine.from_state(shape, random_weights(shape, torch.float32, seed=0), EngineOptions(device="cpu"))
    layers = [layer.attention for layer in engine.model.layers]
    assert engine.kernels.attention == "torch" and all(a.decode_kernel is None for a in layers)
    assert [a.window for a in layers] == [shape.sliding_window, None, None]
    use_attention_kernel(engine.model, "triton")
    assert all(a.decode_kernel is fused_decode_attention for a in layers)
    use_attention_kernel(engine.model, "triton", pdl=True)
    assert all(a.decode_kernel is fused_decode_attention_pdl for a in layers)
    use_attention_kernel(engine.model, "cpp")
    assert all(a.decode_kernel is cpu_attention.decode_attention for a in layers)
    use_attention_kernel(engine.model, "torch")
    assert all(a.decode_kernel is None for a in layers)


def test_a_paged_caches_decode_steps_give_the_kernel_the_block_table():
    """Compiled-step code (taken eagerly) over a paged cache calls the decode kernel with its layer's cache buffer and
    the model's block table, and takes its result: here the PyTorch code's, so the logits are those without the
    kernel. The batch-invariant ``rows_kernel`` reads static caches only: a paged cache's steps never call it."""
    model = random_model(model_configs()["tiny"])
    calls, rows_calls = [], []

    def kernel(q, k, v, cos, sin, kv, input_pos, first_row, scale, softcap, window, table):
        assert table is model.block_table.blocks
        (cache,) = [layer.attention.kv_cache for layer in model.layers if layer.attention.kv_cache.kv is kv]
        calls.append(first_row)
        return reference_attention(q, k, v, cos, sin, cache, input_pos, first_row, scale, softcap, window)

    for layer in model.layers:
        layer.attention.rows_kernel = lambda *args: rows_calls.append(args)
    expected = decoded_logits(model, None, rows_apart=True, paged=True)
    torch.testing.assert_close(decoded_logits(model, kernel, rows_apart=True, paged=True), expected)
    assert len(calls) == 5 * len(model.layers) and not rows_calls


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.skipif(
    tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4),
    reason="Triton 3.6's interpreter takes int() of 1-element arrays, an error since numpy 2.4",
)
def test_the_triton_kernel_in_the_interpreter_matches_the_pytorch_code():
    """MHA, GQA and MQA; head_dim 16, 64, 96, 128; positions first, last and each row's own; cache rows after the
    first; one split and several; sliding windows; soft-capping: the output and the cache after the write, then tiny
    models decoding with the kernel. float32 agrees to rounding; bfloat16 within a few of its ulps (the interpreter
    rounds float32 to bfloat16 by truncation, the GPU to nearest)."""
    errors: dict = {}
    for out in interpret_all([[str(REFERENCE), part] for part in ("float32", "bfloat16", "models")]):  # a process each
        errors |= json.loads(out)
    assert errors["float32"][0] < 1e-5 and errors["float32"][1] == 0.0
    assert errors["bfloat16"][0] < 2e-2 and errors["bfloat16"][1] <= 2**-7  # an ulp
    assert errors["models"] < 1e-5


@pytest.mark.slow
@needs_triton
@old_numpy
def test_the_triton_kernel_over_a_paged_cache_in_the_interpreter_matches_the_pytorch_code():
    """Rows at their own positions over a shuffled block table, a row on the sink block, first rows after the first;
    GQA, MHA and MQA; blocks of 16 and of 12 positions (loop steps across blocks); a sliding window with soft-capping;
    a long row over 19 of 32 splits: the output and the cache after the write (the new keys in their rows' blocks).
    Tiny models decoding over a paged cache are in the static test's models part."""
    errors: dict = {}
    for out in interpret_all([[str(REFERENCE), f"paged-{dtype}"] for dtype in ("float32", "bfloat16")]):
        errors |= json.loads(out)
    assert errors["paged-float32"][0] < 1e-5 and errors["paged-float32"][1] == 0.0
    assert errors["paged-bfloat16"][0] < 2e-2 and errors["paged-bfloat16"][1] <= 2**-7  # an ulp


@pytest.mark.slow
@needs_triton
@old_numpy
def test_the_triton_kernel_reads_and_writes_a_float8_cache_in_the_interpreter():
    """A bfloat16 model's float8 cache, static and paged, every case of the tests above: the new key and value
    written exactly (they are float8 values here, unrotated: Triton 3.6's interpreter rounds to float8 without carrying
    into the exponent, so GPU tests check the rounding) and the output within bfloat16's rounding of the model's
    code reading the same cache."""
    errors: dict = {}
    for out in interpret_all([[str(REFERENCE), part] for part in ("float8", "paged-float8")]):
        errors |= json.loads(out)
    for part in ("float8", "paged-float8"):
        assert errors[part][0] < 2e-2 and errors[part][1] == 0.0, errors


@needs_triton
@pytest.mark.parametrize("kind", ["decode", "rows", "paged", "paged-float8"])
@pytest.mark.parametrize("group", [1, 4])
def test_the_kernel_compiles_for_a_gpu_with_float64_scalars(group, kind):
    """Inductor passes a triton_op's float arguments (the scale, the soft-cap) as float64: the kernel must keep its
    running softmax state in float32 all the same. Triton's front end types the kernel without a GPU: a decode
    step's, a batch-invariant step's (``rows``: the keys from the cache) and a paged cache's decode step's, over a
    16-bit cache and a float8 one (on the tensor cores with float16 operands; MHA's decode step with its weighted
    values per position)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpt_fast.kernels.triton_decode_attention import _decode_attention_split

    kernel = _decode_attention_split
    dot = kind == "paged-float8"  # on the tensor cores, float16 operands
    sizes = {"H_KV": 8, "GROUP": group, "GROUP_PAD": 16 if dot else group, "HALF": 64, "HALF_PAD": 64, "BLOCK_S": 16}
    constants = {**sizes, "SPLIT_LEN": 128, "SPLITS": 4, "MAX_SPLITS": 32, "SOFTCAP": True, "WINDOW": group > 1}
    constants.update(CAPPED=group > 1, FROM_CACHE=kind == "rows")  # group 1 as Llama-2-7B's: no window, no cap
    paged = kind.startswith("paged")
    constants.update(PAGED=paged, CACHE_BLOCK=16 if paged else 1, DOT=dot, MMA16=dot)
    constants.update(ACC_POS=group == 1 and kind == "decode")  # MHA's weighted values per position
    pointers = {"pos_ptr": "*i64", "table_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32"}
    if kind.endswith("float8"):
        pointers["kv_ptr"] = "*fp8e4nv"
    signature = {name: "constexpr" if name in constants else "i64" for name in kernel.arg_names}
    signature.update({name: pointers.get(name, "*bf16") for name in kernel.arg_names if name.endswith("_ptr")})
    signature.update(scale="fp64", softcap="fp64")
    source = ASTSource(kernel, signature, constexprs=constants)
    assert "cubin" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm
