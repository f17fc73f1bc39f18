"""What a quantized checkpoint holds: the swapped model's state, the loader's expected names, shapes and dtypes,
and the cheap count of tensors and bytes all agree."""

import pytest
import torch

from gpt_fast.model.config import EmbeddingQuant, QuantConfig
from gpt_fast.model.shapes import SHAPES, get_shape
from gpt_fast.model.transformer import Transformer, weight_bytes_per_token
from gpt_fast.quant.layers import Int4Linear, Int8Embedding, Int8Linear, quantize_linears
from gpt_fast.quant.layout import quantize_state, quantized_linears, stored_size, stored_specs

SCHEMES = [
    QuantConfig("int8"),
    QuantConfig("int8", output=True),
    QuantConfig("int4", 128),
    QuantConfig("int4", 32, True),
    QuantConfig("int4", 64, method="gptq", keep_float=("layers.0.feed_forward.w2", "layers.1.attention.wqkv")),
]


def scheme_id(quant):
    return quant.name.replace(" ", "_") + ("-output" if quant.output else "")


def swapped_model(shape, quant):
    with torch.device("meta"):
        model = Transformer(shape)
        quantize_linears(model, shape, quant)
    return model


@pytest.mark.parametrize("quant", SCHEMES, ids=scheme_id)
@pytest.mark.parametrize("shape_name", ["tiny", "smollm2-135m"])
def test_the_swapped_model_holds_what_the_loader_expects(shape_name, quant):
    shape = get_shape(shape_name)
    model = swapped_model(shape, quant)
    found = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    assert found == stored_specs(shape, quant, torch.float32)
    quantized = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    assert len(quantized) == 4 * shape.n_layer + quant.output - len(quant.keep_float)
    assert (model.output is not None) == (quant.output or not shape.tie_embeddings)


@pytest.mark.parametrize("quant", [None, *SCHEMES], ids=lambda q: "float" if q is None else scheme_id(q))
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_the_cheap_count_agrees_with_the_listing(shape_name, quant):
    shape, dtype = get_shape(shape_name), torch.bfloat16
    if quant is not None and shape.n_experts:
        pytest.skip("a mixture of experts is not quantized (test_a_mixture_of_experts_is_refused)")
    specs = stored_specs(shape, quant, dtype)
    size = sum(torch.Size(s).numel() * d.itemsize for s, d in specs.values())
    assert stored_size(shape, quant, dtype) == (len(specs), size)


TABLES = [
    QuantConfig("int8", embeddings=EmbeddingQuant()),
    QuantConfig("int4", 32, embeddings=EmbeddingQuant("int8", 32)),
]
TIED = [name for name, shape in SHAPES.items() if shape.tie_embeddings and not shape.n_experts]


@pytest.mark.parametrize("quant", TABLES, ids=scheme_id)
@pytest.mark.parametrize("shape_name", TIED)
def test_a_table_quantized_in_place_is_counted_and_swapped_alike(shape_name, quant):
    """``quantization.embeddings``: the swapped model holds one quantized table (no output projection apart),
    what the loader expects and the cheap count says."""
    shape, dtype = get_shape(shape_name), torch.bfloat16
    specs = stored_specs(shape, quant, dtype)
    assert specs["tok_embeddings.weight"] == ((shape.vocab_size, shape.dim), torch.int8)
    size = sum(torch.Size(s).numel() * d.itemsize for s, d in specs.values())
    assert stored_size(shape, quant, dtype) == (len(specs), size)
    model = swapped_model(shape, quant)
    assert isinstance(model.tok_embeddings, Int8Embedding) and model.output is None
    found = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    assert found == stored_specs(shape, quant, torch.float32)


@pytest.mark.parametrize("quant", TABLES, ids=scheme_id)
def test_bytes_per_token_count_a_quantized_table_once(quant):
    """A tied table quantized in place is the output projection: a decode step reads all of it, once."""
    import dataclasses

    from gpt_fast.convert.random_init import random_weights

    shape = dataclasses.replace(get_shape("tiny"), tie_embeddings=True)
    state = quantize_state(random_weights(shape, torch.float32, seed=0), shape, quant, torch.float32)
    assert state["tok_embeddings.weight"].dtype == torch.int8
    model = swapped_model(shape, quant)
    model.load_state_dict(state, assign=True)
    assert weight_bytes_per_token(model) == sum(t.numel() * t.element_size() for t in state.values())


def test_tied_output_is_quantized_from_the_embedding_table():
    shape = get_shape("smollm2-135m")
    assert quantized_linears(shape, QuantConfig("int8", output=True))["output"] == (shape.vocab_size, shape.dim)
    assert "output" not in quantized_linears(shape, QuantConfig("int8"))


@pytest.mark.parametrize("quant", SCHEMES, ids=scheme_id)
def test_bytes_per_token_count_the_quantized_tensors(quant):
    """A decode step reads the quantized weights, their scales and zeros, the norms, and the embedding table
    only where it is the output projection."""
    from gpt_fast.convert.random_init import random_weights

    shape = get_shape("tiny")
    state = quantize_state(random_weights(shape, torch.float32, seed=0), shape, quant, torch.float32)
    model = swapped_model(shape, quant)
    model.load_state_dict(state, assign=True)
    embedding = state["tok_embeddings.weight"].numel() * 4
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert weight_bytes_per_token(model) == total - embedding  # tiny's output is untied, or quantized apart


def test_biases_stay_in_float_beside_the_quantized_weights():
    """Qwen2's q/k/v biases: kept by the quantized layer, and the quantized model stays close to the float one."""
    import dataclasses

    from gpt_fast.checkpoint.load import model_from_state
    from gpt_fast.convert.random_init import random_weights

    shape = dataclasses.replace(get_shape("tiny"), qkv_bias=True)
    state = random_weights(shape, torch.float32, seed=0)
    state["layers.0.attention.wqkv.bias"] = torch.randn_like(state["layers.0.attention.wqkv.bias"])
    cpu, tokens = torch.device("cpu"), torch.randint(0, shape.vocab_size, (1, 12))
    logits = {}
    for quant in (None, QuantConfig("int8")):
        quantized = state if quant is None else quantize_state(state, shape, quant, torch.float32)
        model = model_from_state(shape, quantized, cpu, torch.float32, quant)
        model.setup_caches(1, 16)
        with torch.no_grad():
            logits[quant] = model(tokens, torch.arange(12))
    assert torch.equal(model.layers[0].attention.wqkv.bias, state["layers.0.attention.wqkv.bias"])
    error = (logits[QuantConfig("int8")] - logits[None]).norm() / logits[None].norm()
    assert error < 0.01


def test_a_mixture_of_experts_is_refused():
    with pytest.raises(
        ValueError, match=r"quantization of a mixture of experts is not supported \(model.n_experts = 8\)"
    ):
        QuantConfig("int4", 128).check_model(get_shape("mixtral-8x7b"))
