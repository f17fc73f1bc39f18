"""The layers of a CPU decode step in one C++ operator (``--layers_kernel cpp``, :mod:`gpt_fast.kernels.cpu_layers`):
which models and options it takes, which steps call it, and that its steps give the logits of the model's own code
(the PyTorch layers, the reference here) for float32 and quantized weights and each family feature it computes."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from gpt_fast.accel.choice import Context
from gpt_fast.accel.options import KernelOptions
from gpt_fast.accel.persistent import check_cpp_layers, resolve_layers_kernel, use_layers_kernel
from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.kernels import cpu_gemv
from gpt_fast.model import transformer
from gpt_fast.model.config import EmbeddingQuant, QuantConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.quant.layout import quantize_state

needs_cpp = pytest.mark.skipif(not cpu_gemv.cpu_kernels_usable(), reason="our C++ kernels do not build here")
CPU = torch.device("cpu")
GREEDY = SamplingConfig(temperature=0.0)
# tiny, with inputs of every product a multiple of 64 (int4's kernels take those)
SHAPE = dataclasses.replace(get_shape("tiny"), intermediate_size=192)


def context(**fields: object) -> Context:
    return Context(**{"device": CPU, "compile_mode": "none", "config": SHAPE, "dtype": torch.float32, **fields})


@needs_cpp
def test_auto_takes_it_where_it_computes_the_model():
    assert resolve_layers_kernel("auto", context()) == "cpp"
    assert resolve_layers_kernel("auto", context(quantization=QuantConfig("int8"), quant_kernel="cpp-q8")) == "cpp"
    for other in (
        {"dtype": torch.bfloat16},
        {"dtype": None},  # not known
        {"quantization": QuantConfig("int8"), "quant_kernel": "aten"},
        {"quantization": QuantConfig("int4", group_size=32), "quant_kernel": "cpp", "config": get_shape("tiny")},
        {"config": dataclasses.replace(SHAPE, qk_norm=True)},
        {"tensor_parallel": True},
    ):
        assert resolve_layers_kernel("auto", context(**other)) == "torch", other
    assert resolve_layers_kernel("auto", context(device=torch.device("cuda"))) == "torch"


@needs_cpp
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"dtype": torch.bfloat16}, "does not compute models with torch.bfloat16 weights"),
        ({"quantization": QuantConfig("int8"), "quant_kernel": "dequant"}, "the dequant quantized kernel"),
        (
            {"quantization": QuantConfig("int4", group_size=32), "config": get_shape("tiny")},
            "quantized layers whose shapes our C\\+\\+ products do not take",
        ),
        ({"config": dataclasses.replace(SHAPE, post_norms=True)}, "does not compute models with post-norms"),
        ({"config": dataclasses.replace(SHAPE, head_dim=12)}, "a head size that is not a multiple of 8"),
        ({"tensor_parallel": True}, "does not compute models with tensor parallelism"),
        ({"batch_invariant": True}, "does not compute models with batch-invariant steps"),
    ],
)
def test_what_it_refuses_by_name(fields, message):
    with pytest.raises(ValueError, match=f"--layers_kernel cpp {message}" if "does not" in message else message):
        check_cpp_layers(context(**fields))


def test_it_needs_our_cpu_kernels():
    with pytest.raises(ValueError, match="the cpp layers kernel needs an x86 CPU with AVX2"):
        check_cpp_layers(context(device=torch.device("cuda")))
    with pytest.raises(ValueError, match="kernels.layers 'mega' is not one of auto, triton, cpp, torch"):
        EngineOptions(kernels=KernelOptions(layers="mega"))


def engines(config, quant=None, quant_kernel="auto", kv_cache_dtype="auto"):
    """The same weights with the C++ layers and with the model's own."""
    state = random_weights(config, torch.float32, seed=0)
    if quant is not None:
        state = quantize_state(state, config, quant, torch.float32)
    made = {}
    for layers in ("cpp", "torch"):
        kernels = KernelOptions(quant=quant_kernel, layers=layers)
        options = EngineOptions(device="cpu", kernels=kernels, kv_cache_dtype=kv_cache_dtype)
        made[layers] = Engine.from_state(config, state, options, quant)
    return made["cpp"], made["torch"]


def step_logits(engine, tokens, steps):
    """The logits of a prompt's prefill and of ``steps`` decode steps, each fed the next of ``tokens``."""
    model = engine.model
    model.setup_caches(1, 64)
    with torch.no_grad():
        out = [model(torch.tensor([tokens[:4]]), torch.arange(4), from_start=True)[0, -1]]
        for i in range(steps):
            pos = torch.tensor([4 + i])
            out.append(model(torch.tensor([[tokens[4 + i]]]), pos)[0, -1])
    return torch.stack(out)  # [1 + steps, V]


FEATURES = {
    "llama": {},
    "qkv bias": {"qkv_bias": True},
    "norm offset": {"norm_offset": 1.0},
    "geglu": {"mlp_activation": "gelu_tanh"},
    "soft-capped": {"attn_logit_softcap": 5.0, "query_pre_attn_scalar": 24.0},
    "one kv head": {"n_local_heads": 1},
    "MLP width 108": {"intermediate_size": 108},  # the float32 products' 32-, 8- and 1-column steps (w2: 96 + 8 + 4)
}


@needs_cpp
@pytest.mark.parametrize("features", FEATURES.values(), ids=FEATURES.keys())
def test_float32_steps_give_the_model_codes_logits(features):
    config = dataclasses.replace(SHAPE, **features)
    cpp, plain = engines(config)
    assert cpp.kernels.layers == "cpp" and plain.kernels.layers == "torch"
    tokens = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, reference = step_logits(cpp, tokens, 20), step_logits(plain, tokens, 20)
    assert torch.allclose(ours, reference, rtol=1e-4, atol=1e-4), (ours - reference).abs().max()


QUANTS = {
    "int8 cpp": (QuantConfig("int8"), "cpp"),
    "int8 cpp-q8": (QuantConfig("int8"), "cpp-q8"),
    "int4 cpp": (QuantConfig("int4", group_size=32), "cpp"),
    "int4 cpp-q8": (QuantConfig("int4", group_size=64), "cpp-q8"),
}


@needs_cpp
@pytest.mark.parametrize("quant, kernel", QUANTS.values(), ids=QUANTS.keys())
def test_quantized_steps_give_the_model_codes_logits(quant, kernel):
    """The products are the same kernels on either side: what differs is the code around them. The q8 kernels
    round each row to int8, which turns the float32 sums' differences into a level at most now and then."""
    config = dataclasses.replace(SHAPE, qkv_bias=True)
    cpp, plain = engines(config, quant, kernel)
    assert cpp.model.layers[0].attention.wqkv.kernel == kernel
    tokens = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    ours, reference = step_logits(cpp, tokens, 20), step_logits(plain, tokens, 20)
    tolerance = 2e-2 if kernel == "cpp-q8" else 1e-4
    assert torch.allclose(ours, reference, rtol=tolerance, atol=tolerance), (ours - reference).abs().max()


@needs_cpp
def test_one_token_steps_call_it_prefills_do_not(monkeypatch):
    """Prefills keep the layers' code; a one-token step calls the operator, of one row or of several."""
    cpp, _ = engines(SHAPE)
    calls = []
    operator = torch.ops.gpt_fast.decode_layers_cpu
    monkeypatch.setattr(
        "gpt_fast.kernels.cpu_layers.torch.ops.gpt_fast",
        type("Ops", (), {"decode_layers_cpu": staticmethod(lambda *a: calls.append(1) or operator(*a))}),
    )
    step_logits(cpp, list(range(10)), 3)
    assert len(calls) == 3
    model = cpp.model
    model.setup_caches(2, 64)
    with torch.no_grad():
        model(torch.tensor([[1, 2], [3, 4]]), torch.arange(2), from_start=True)
        model(torch.tensor([[1], [2]]), torch.tensor([[2], [2]]))
    assert len(calls) == 4


def rows_logits(engine, prompts, steps, paged):
    """A server's steps on ``engine``: each prompt prefilled alone into its row (cache rows 1 onwards), then
    ``steps`` decode steps of all the rows at once, each row at its own position, and one step of the last two rows
    alone (``first_row``); the logits of every step [steps + 1, rows, V]. ``paged``: blocks of 4 positions, each row's
    in a shuffled order."""
    model, rows = engine.model, len(prompts)
    if paged:
        model.setup_caches(rows + 1, 64, blocks=1 + (rows + 1) * 16, block_size=4)
        order = torch.randperm((rows + 1) * 16, generator=torch.Generator().manual_seed(6))
        model.block_table.blocks.copy_(1 + order.view(rows + 1, 16))
    else:
        model.setup_caches(rows + 1, 64)
    generator = torch.Generator().manual_seed(7)
    out = []
    with torch.no_grad():
        for row, prompt in enumerate(prompts, start=1):
            model(torch.tensor([prompt]), torch.arange(len(prompt)), first_row=row)
        positions = torch.tensor([[len(prompt)] for prompt in prompts])  # [rows, 1]
        for _ in range(steps):
            tokens = torch.randint(0, model.config.vocab_size, (rows, 1), generator=generator)
            out.append(model(tokens, positions, first_row=1)[:, -1])
            positions = positions + 1
        tokens = torch.randint(0, model.config.vocab_size, (2, 1), generator=generator)
        out.append(torch.cat([out[-1][:-2], model(tokens, positions[-2:], first_row=rows - 1)[:, -1]]))
    return torch.stack(out)


ROWS = {  # and rows: an int4 product of 7 rows is a matrix product (CPP_INT4_GEMV_ROWS)
    "float32": (None, "auto", 3),
    "int8 cpp": (QuantConfig("int8"), "cpp", 3),
    "int4 cpp, 7 rows": (QuantConfig("int4", group_size=32), "cpp", 7),
}


@needs_cpp
@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("quant, kernel, rows", ROWS.values(), ids=ROWS.keys())
def test_steps_of_many_rows_give_the_model_codes_logits(quant, kernel, rows, paged):
    """A server's step: rows at their own positions, rows of the cache from ``first_row`` on, static or paged."""
    config = dataclasses.replace(SHAPE, qkv_bias=True)
    cpp, plain = engines(config, quant, kernel)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13, 14], [15], [16, 17, 18, 19], [20, 21], [22, 23, 24]][:rows]
    ours, reference = rows_logits(cpp, prompts, 6, paged), rows_logits(plain, prompts, 6, paged)
    assert torch.allclose(ours, reference, rtol=1e-4, atol=1e-4), (ours - reference).abs().max()


@needs_cpp
@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize(
    "cache_dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn], ids=["float16", "bfloat16", "float8"]
)
def test_a_narrower_cache_gives_the_model_codes_logits(cache_dtype, paged):
    """``--kv_cache_dtype``: a server's steps over a float16, bfloat16 or float8 cache, against the model's code
    over the same cache (keys and values rounded as they are written, read back as float32)."""
    config = dataclasses.replace(SHAPE, qkv_bias=True)
    cpp, plain = engines(config, kv_cache_dtype=str(cache_dtype).removeprefix("torch."))
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11, 12], [13, 14]]
    ours, reference = rows_logits(cpp, prompts, 6, paged), rows_logits(plain, prompts, 6, paged)
    assert cpp.kernels.layers == "cpp" and cpp.model.layers[0].attention.kv_cache.kv.dtype == cache_dtype
    assert plain.model.layers[0].attention.kv_cache.kv.dtype == cache_dtype
    assert cpp.model.paged_heads_major and not plain.model.paged_heads_major
    assert torch.allclose(ours, reference, rtol=1e-4, atol=1e-4), (ours - reference).abs().max()


@needs_cpp
def test_greedy_tokens_are_the_model_codes_compiled_and_eager():
    """Greedy decoding with the operator, eager and compiled, gives the tokens of the model's code."""
    state = random_weights(SHAPE, torch.float32, seed=3)
    tokens = {}
    for name, compile_mode, layers in (
        ("torch", "none", "torch"),
        ("eager", "none", "cpp"),
        ("compiled", "default", "cpp"),
    ):
        torch._dynamo.reset()
        options = EngineOptions(device="cpu", compile=compile_mode, kernels=KernelOptions(layers=layers))
        engine = Engine.from_state(SHAPE, state, options)
        tokens[name] = engine.generate_ids([5, 6, 7], 24, GREEDY).tokens
    assert tokens["eager"] == tokens["torch"] == tokens["compiled"]


TABLE = EmbeddingQuant("int8", group_size=32)  # the default model's CPU table (a GGUF's Q8_0 blocks)
HEADS = {
    "float32 output": (dataclasses.replace(SHAPE, final_logit_softcap=30.0), None, "auto"),
    "float32 tied table": (dataclasses.replace(SHAPE, tie_embeddings=True), None, "auto"),
    "int8 table cpp": (dataclasses.replace(SHAPE, tie_embeddings=True), QuantConfig("int8", embeddings=TABLE), "cpp"),
    "int8 table cpp-q8": (
        dataclasses.replace(SHAPE, tie_embeddings=True),
        QuantConfig("int8", embeddings=TABLE),
        "cpp-q8",
    ),
    "int4 with an int8 output copy": (SHAPE, QuantConfig("int4", group_size=32, output=True), "cpp"),
}


@needs_cpp
@pytest.mark.parametrize("config, quant, kernel", HEADS.values(), ids=HEADS.keys())
def test_the_operator_computes_the_final_norm_and_the_head(config, quant, kernel):
    """Where our products compute the output projection, the operator returns the logits (the final norm and the
    head inside it; a soft-cap after it), and they are the model's code's."""
    cpp, plain = engines(config, quant, kernel)
    assert cpp.model.layers_kernel_logits and not plain.model.layers_kernel_logits
    tokens = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    ours, reference = step_logits(cpp, tokens, 20), step_logits(plain, tokens, 20)
    tolerance = 2e-2 if kernel == "cpp-q8" else 1e-4
    assert torch.allclose(ours, reference, rtol=tolerance, atol=tolerance), (ours - reference).abs().max()


@needs_cpp
def test_a_head_our_products_do_not_compute_stays_the_models():
    """A quantized table on the dequantizing kernel: the operator returns the residual, the model does the rest."""
    config = dataclasses.replace(SHAPE, tie_embeddings=True)
    quant = QuantConfig("int8", embeddings=TABLE)
    cpp, plain = engines(config, quant, "cpp")
    cpp.model.tok_embeddings.kernel = "dequant"
    use_layers_kernel(cpp.model, "cpp")
    assert not cpp.model.layers_kernel_logits
    tokens = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    ours, reference = step_logits(cpp, tokens, 8), step_logits(plain, tokens, 8)
    assert torch.allclose(ours, reference, rtol=1e-4, atol=1e-4), (ours - reference).abs().max()


@needs_cpp
def test_the_caches_are_listed_once_per_set_up_and_freed_before_new_ones(monkeypatch):
    """The operator's list of the caches holds no old cache while the new ones are allocated."""
    cpp, _ = engines(SHAPE)
    model = cpp.model
    model.setup_caches(1, 64)
    caches = [layer.attention.kv_cache.kv.data_ptr() for layer in model.layers]
    assert [kv.data_ptr() for kv in model.layers_kernel_caches] == caches
    old = weakref.ref(model.layers[0].attention.kv_cache.kv)
    alive_at_allocation = []
    make_cache = transformer.KVCache

    def allocating(*args, **kwargs):
        alive_at_allocation.append(old() is not None)
        return make_cache(*args, **kwargs)

    monkeypatch.setattr(transformer, "KVCache", allocating)
    model.setup_caches(1, 32)
    assert alive_at_allocation and not any(alive_at_allocation)
    assert model.layers_kernel_caches[0].shape[3] == 32
    model.setup_caches(2, 64, blocks=16)
    caches = [layer.attention.kv_cache.kv for layer in model.layers]
    assert [kv.data_ptr() for kv in model.layers_kernel_caches] == [kv.data_ptr() for kv in caches]
    assert model.layers_kernel_caches[0].shape[1] == 16  # the paged caches' blocks
