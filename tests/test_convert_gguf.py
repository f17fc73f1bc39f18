"""GGUF file -> our checkpoint: a synthetic llama GGUF holding every supported tensor type, compared with
transformers loading the same file; and broken files."""

import json
import re
import struct

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from test_families import PROMPT, cached_logits, hf_model
from tiny import hf_greedy, our_greedy, train_bpe_tokenizer

from gpt_fast.convert.gguf_file import convert_gguf
from gpt_fast.engine.engine import Engine
from gpt_fast.model.config import EmbeddingQuant, QuantConfig
from gpt_fast.quant.schemes import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

DIM, HEADS, KV_HEADS, INTER, LAYERS = 256, 4, 2, 512, 2  # K-quant rows hold multiples of 256 values
LAYER_TYPES = [
    {
        "attn_q": Q.Q4_K,
        "attn_k": Q.Q5_K,
        "attn_v": Q.Q6_K,
        "attn_output": Q.Q8_0,
        "ffn_gate": Q.Q4_0,
        "ffn_up": Q.Q4_1,
        "ffn_down": Q.F16,
    },
    {
        "attn_q": Q.BF16,
        "attn_k": Q.F32,
        "attn_v": Q.Q8_0,
        "attn_output": Q.Q4_K,
        "ffn_gate": Q.Q5_K,
        "ffn_up": Q.Q6_K,
        "ffn_down": Q.Q4_1,
    },
]
MODEL_ARCH_BY_NAME = {name: arch for arch, name in MODEL_ARCH_NAMES.items()}
K_QUANT_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # where each block keeps its f16 scales


def k_quant_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks (gguf-py cannot quantize these) with small, finite f16 scales."""
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_values, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.004).tobytes(), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS[qtype]:
        blocks[:, :, offset : offset + 2] = scale
    return blocks.reshape(rows, -1)


def encode(weight: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype == Q.F32:
        return weight.astype(np.float32)
    if qtype in K_QUANT_SCALE_OFFSETS:
        return k_quant_blocks(*weight.shape, qtype, rng)
    return quantize(weight.astype(np.float32), qtype)


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k layout: each head's rotary halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def llama_writer(path, tokenizer, architecture="llama", sizes=(DIM, HEADS, KV_HEADS, INTER, LAYERS), context=512):
    """A GGUF writer holding a llama model's metadata and ``tokenizer``; ``sizes``: (dim, heads, KV heads, hidden
    size of the MLP, layers)."""
    dim, heads, kv_heads, inter, layers = sizes
    writer = GGUFWriter(str(path), architecture)
    writer.add_context_length(context)
    writer.add_embedding_length(dim)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(tokenizer.get_vocab_size())
    add_tokenizer(writer, tokenizer)
    return writer


def layer_shapes(dim=DIM, heads=HEADS, kv_heads=KV_HEADS, inter=INTER):
    """A llama layer's weight matrices, by GGUF name part: their [out, in] shapes."""
    kv = kv_heads * (dim // heads)
    return {
        "attn_q": (dim, dim),
        "attn_k": (kv, dim),
        "attn_v": (kv, dim),
        "attn_output": (dim, dim),
        "ffn_gate": (inter, dim),
        "ffn_up": (inter, dim),
        "ffn_down": (dim, inter),
    }


def add_random_tensor(writer, rng, name, shape, qtype, heads=HEADS, kv_heads=KV_HEADS):
    """Random values drawn from ``rng`` (norms near 1; q and k in llama.cpp's layout) written as ``qtype``; returns
    the array written."""
    data = rng.normal(0, 0.25, size=shape).astype(np.float32)
    if name.endswith("norm.weight"):
        data = 1 + 0.1 * data
    if name.endswith(("attn_q.weight", "attn_k.weight")):
        data = llama_cpp_permute(data, heads if "attn_q" in name else kv_heads)
    encoded = encode(data, qtype, rng)
    writer.add_tensor(name, encoded, raw_shape=encoded.shape, raw_dtype=qtype)
    return encoded


def write_gguf(path, tokenizer, *, architecture="llama", tied=False, seed=0, rope_freqs=None, edit=None):
    """A synthetic llama GGUF; ``edit(writer)``, if given, runs last, before the file is written."""
    rng = np.random.default_rng(seed)
    vocab = tokenizer.get_vocab_size()
    writer = llama_writer(path, tokenizer, architecture)

    def tensor(name, shape, qtype):
        add_random_tensor(writer, rng, name, shape, qtype)

    tensor("token_embd.weight", (vocab, DIM), Q.Q8_0)
    shapes = layer_shapes()
    for layer, types in enumerate(LAYER_TYPES):
        for part, qtype in types.items():
            tensor(f"blk.{layer}.{part}.weight", shapes[part], qtype)
        tensor(f"blk.{layer}.attn_norm.weight", (DIM,), Q.F32)
        tensor(f"blk.{layer}.ffn_norm.weight", (DIM,), Q.F32)
    tensor("output_norm.weight", (DIM,), Q.F32)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if not tied:
        tensor("output.weight", (vocab, DIM), Q.Q6_K)
    if edit is not None:
        edit(writer)
    return write_out(writer, path)


def add_tokenizer(writer, tokenizer):
    """The byte-level BPE ``tokenizer`` as llama.cpp's converter writes a "gpt2" vocabulary."""
    tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in tokens])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.token_to_id("<s>"))
    writer.add_eos_token_id(tokenizer.token_to_id("</s>"))
    writer.add_add_bos_token(True)


def write_out(writer, path):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_bpe_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def synthetic(request, tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("gguf")
    path = write_gguf(folder / "tiny.gguf", tokenizer, tied=request.param)
    convert_gguf(path, folder / "out")
    return path, folder / "out"


@torch.no_grad()
def test_logits_match_transformers_loading_the_same_file(synthetic):
    from transformers import AutoModelForCausalLM

    path, out = synthetic
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    engine = Engine.load(out, device="cpu", dtype="float32")
    model, config = engine.model, engine.config
    assert config.dtype == "float32"
    tokens = torch.randint(0, config.model.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    model.setup_caches(1, 64)
    expected = reference(tokens).logits
    diff = (model(tokens, torch.arange(40)) - expected).abs().max().item()
    assert diff < 1e-5 * expected.abs().max().item(), (diff, expected.abs().max().item())


def test_config_comes_from_the_metadata(synthetic):
    _, out = synthetic
    config = Engine.load(out, device="cpu", dtype="float32").config
    assert (config.model.dim, config.model.n_head, config.model.n_local_heads, config.model.block_size) == (
        DIM,
        HEADS,
        KV_HEADS,
        512,
    )
    assert config.source["kind"] == "gguf"


def test_rope_freqs_tensor_becomes_divisors(tmp_path, tokenizer):
    divisors = np.linspace(1.0, 8.0, DIM // HEADS // 2)
    convert_gguf(write_gguf(tmp_path / "scaled.gguf", tokenizer, rope_freqs=divisors), tmp_path / "out")
    config = Engine.load(tmp_path / "out", device="cpu", dtype="float32").config
    assert config.model.rope_scaling.kind == "divisors"
    np.testing.assert_allclose(config.model.rope_scaling.divisors, divisors, rtol=1e-6)


def test_truncated_gguf(tmp_path, tokenizer):
    path = write_gguf(tmp_path / "tiny.gguf", tokenizer)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="tiny.gguf is not a readable GGUF file"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="bad.gguf is not a readable GGUF file"):
        convert_gguf(path, tmp_path / "out")


def gguf_from_hf(path, hf, tokenizer, architecture):
    """``hf`` (a transformers model) written in float32 as llama.cpp's convert_hf_to_gguf writes ``architecture``:
    its metadata keys, the gguf library's tensor names for the HF ones, q/k rows as they are (it interleaves the
    rotary halves for llama only), no output tensor when the embeddings are tied."""
    config = hf.config
    writer = GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    add_tokenizer(writer, tokenizer)
    names = get_tensor_name_map(MODEL_ARCH_BY_NAME[architecture], config.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    return write_out(writer, path)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@torch.no_grad()
def test_families_from_gguf_match_transformers(tmp_path, family):
    """Qwen2 (q/k/v biases, tied embeddings, rope base 1e6) and Qwen3 (qk-norm) from llama.cpp's GGUF layout:
    transformers' logits over a prompt and 40 tokens decoded with our KV cache, and its greedy tokens."""
    tokenizer = train_bpe_tokenizer(tmp_path / "tok", vocab_size=300)
    hf = hf_model(family, tokenizer.get_vocab_size())
    convert_gguf(gguf_from_hf(tmp_path / f"{family}.gguf", hf, tokenizer, family), tmp_path / "out")
    engine = Engine.load(tmp_path / "out", device="cpu", dtype="float32")
    assert engine.config.source["architecture"] == family
    generated = hf_greedy(hf, PROMPT, 40)
    assert our_greedy(engine, PROMPT, 40) == generated
    tokens = PROMPT + generated
    expected = hf(torch.tensor([tokens])).logits[0]
    assert (cached_logits(engine.model, tokens, len(PROMPT)) - expected).abs().max().item() < 1e-4


def test_unsupported_architecture(tmp_path, tokenizer):
    path = write_gguf(tmp_path / "other.gguf", tokenizer, architecture="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture gpt2"):
        convert_gguf(path, tmp_path / "out")


def test_the_folder_holding_the_gguf_is_not_written_into(tmp_path, tokenizer):
    path = write_gguf(tmp_path / "tiny.gguf", tokenizer)
    with pytest.raises(FileExistsError, match=f"refusing to write into {tmp_path}: it holds tiny.gguf"):
        convert_gguf(path, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]


def gguf_string(text):
    return struct.pack("<Q", len(text)) + text


def raw_gguf(*, tensors=0, keys=0, body=b"", version=3):
    """A GGUF header written byte by byte, followed by some padding."""
    return b"GGUF" + struct.pack("<IQQ", version, tensors, keys) + body + bytes(64)


def key(name, value_type, payload):
    return gguf_string(name.encode()) + struct.pack("<I", value_type) + payload


def tensor_entry(name, dims, tensor_type, offset):
    return gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, tensor_type, offset)


STRING, ARRAY, UINT8 = 8, 9, 0
# Headers that would make the gguf library (or what follows it) loop, allocate or recurse without bound
HOSTILE_HEADERS = {
    "too short": (b"GGUF\x03\x00", r"truncated \(6 bytes\)"),
    "version 1": (raw_gguf(version=1), r"version 1 \(supported: 2, 3\)"),
    "2**60 tensors": (raw_gguf(tensors=2**60), r"the tensor count is 1152921504606846976 \(at most 65536\)"),
    "2**40 metadata": (raw_gguf(keys=2**40), r"the metadata count is 1099511627776 \(at most 65536\)"),
    "an array of 2**40 bytes": (
        raw_gguf(keys=1, body=key("a", ARRAY, struct.pack("<IQ", UINT8, 2**40))),
        r"the length of array a is 1099511627776 \(at most 1048576\)",
    ),
    "many large arrays": (
        raw_gguf(
            keys=3,
            body=b"".join(key(f"a{i}", ARRAY, struct.pack("<IQ", UINT8, 2**20) + bytes(2**20)) for i in range(3)),
        ),
        r"array a2 brings the metadata's array elements past 2097152",
    ),
    "arrays nested": (
        raw_gguf(keys=1, body=key("a", ARRAY, struct.pack("<IQ", ARRAY, 1) * 1000)),
        r"array a holds arrays \(nested arrays are not supported\)",
    ),
    "a string of 2**40 bytes": (
        raw_gguf(keys=1, body=key("a", STRING, struct.pack("<Q", 2**40))),
        r"string a is 1099511627776 bytes long \(at most 1048576\)",
    ),
    "a string past the end": (
        raw_gguf(keys=1, body=key("a", STRING, struct.pack("<Q", 1000))),
        r"truncated at the string a",
    ),
    "an unknown value type": (raw_gguf(keys=1, body=key("a", 99, b"")), r"metadata a has unknown type 99"),
    "a five-dimensional tensor": (
        raw_gguf(tensors=1, body=tensor_entry(b"t", [1] * 5, 0, 0)),
        r"tensor t has 5 dimensions \(at most 4\)",
    ),
    "an unknown tensor type": (raw_gguf(tensors=1, body=tensor_entry(b"t", [4], 999, 0)), r"tensor t has unknown type"),
    "a tensor past the end": (
        raw_gguf(tensors=1, body=tensor_entry(b"t", [4], 0, 2**40)),
        r"tensor t lies past the end of the file",
    ),
    "alignment zero": (
        raw_gguf(keys=1, body=key("general.alignment", 4, struct.pack("<I", 0))),
        r"general.alignment 0 is not a power of two",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE_HEADERS))
def test_hostile_headers_are_refused_before_the_gguf_library_reads_them(name, tmp_path):
    data, message = HOSTILE_HEADERS[name]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError) as info:
        convert_gguf(path, tmp_path / "out")
    text = str(info.value)
    assert text.startswith(f"{path} is not a readable GGUF file: ") and len(text.splitlines()) == 1, text
    assert re.search(message, text), text
    assert not (tmp_path / "out").exists()


def set_tokens(change):
    def edit(writer):
        tokens = [str(t) for t in writer.kv_data[0]["tokenizer.ggml.tokens"].value]
        types = list(writer.kv_data[0]["tokenizer.ggml.token_type"].value)
        change(tokens, types)
        writer.add_token_list(tokens)
        writer.add_token_types(types)

    return edit


def set_key(name, adder, value):
    return lambda writer: writer.kv_data[0].pop(name, None) and getattr(writer, adder)(name, value)


def set_array(name, change):
    """Replace the array metadata ``name`` by ``change(its values)``, written with the type the values imply."""

    def edit(writer):
        values = [v.decode() if isinstance(v, bytes) else v for v in writer.kv_data[0].pop(name).value]
        writer.add_array(name, change(values))

    return edit


def poison(name):
    def edit(writer):
        writer.tensors[0][name].tensor[3] = np.nan

    return edit


# write_gguf edits -> what the one-line error says
BAD_GGUF_FILES = {
    "a token of a million characters": (
        set_tokens(lambda tokens, types: tokens.__setitem__(5, "a" * 10**6)),
        r"tokenizer.ggml.tokens\[5\] is 1000000 bytes long \(at most 4096\)",
    ),
    "more tokens than the embedding": (
        set_tokens(lambda tokens, types: tokens.append("extra") or types.append(1)),
        r"tokenizer.ggml.tokens: the tokenizer has 301 tokens, more than the model's embedding table "
        r"\(model.vocab_size = 300\)",
    ),
    "width as a string": (
        set_key("llama.embedding_length", "add_string", "256"),
        r"GGUF metadata llama.embedding_length has the wrong type or value \(STRING; it must be a positive integer\)",
    ),
    "zero heads": (
        set_key("llama.attention.head_count", "add_uint32", 0),
        r"llama.attention.head_count has the wrong type or value \(UINT32; it must be a positive integer\)",
    ),
    "nan rope base": (
        set_key("llama.rope.freq_base", "add_float32", float("nan")),
        r"llama.rope.freq_base has the wrong type or value \(FLOAT32; it must be a finite number\)",
    ),
    "infinite rope factor": (
        lambda w: (
            w.add_string("llama.rope.scaling.type", "linear") or w.add_float32("llama.rope.scaling.factor", np.inf)
        ),
        r"llama.rope.scaling.factor has the wrong type or value",
    ),
    "zero rope factor": (
        lambda w: w.add_string("llama.rope.scaling.type", "linear") or w.add_float32("llama.rope.scaling.factor", 0.0),
        r"rope_scaling.factor must be a finite number > 0",
    ),
    "ten million layers": (
        set_key("llama.block_count", "add_uint32", 10**7),
        r"holds 21 tensors, a model of 10000000 layers \(n_layer\) has 90000003",
    ),
    "an integer tensor": (
        lambda w: w.add_tensor("extra.weight", np.zeros(4, dtype=np.int32)),
        r"tensor extra.weight has integer type I32",
    ),
    "nan weight": (poison("blk.0.attn_norm.weight"), r"tensor model.layers.0.input_layernorm.weight holds NaN"),
    "tokens of integers": (
        set_array("tokenizer.ggml.tokens", lambda tokens: list(range(len(tokens)))),
        r"GGUF metadata tokenizer.ggml.tokens "
        r"has the wrong type or value \(ARRAY/INT32; it must be an array of strings",
    ),
    "token types of strings": (
        set_array("tokenizer.ggml.token_type", lambda types: [str(t) for t in types]),
        r"tokenizer.ggml.token_type has the wrong type or value \(ARRAY/STRING; it must be an array of integers\)",
    ),
    "a token type too few": (
        set_array("tokenizer.ggml.token_type", lambda types: types[:-1]),
        r"tokenizer.ggml.token_type has the wrong type or value \(ARRAY/INT32; it must be an array of integers, "
        r"one per token \(300\)\)",
    ),
    "bos id a float": (
        set_key("tokenizer.ggml.bos_token_id", "add_float32", 1.0),
        r"tokenizer.ggml.bos_token_id has the wrong type or value \(FLOAT32; it must be a token id \(an integer\)\)",
    ),
    "bos id a string": (
        set_key("tokenizer.ggml.bos_token_id", "add_string", "1"),
        r"tokenizer.ggml.bos_token_id has the wrong type or value \(STRING; it must be a token id",
    ),
    "eos id outside the vocabulary": (
        set_key("tokenizer.ggml.eos_token_id", "add_int32", -1),
        r"GGUF metadata tokenizer.ggml.eos_token_id -1 is outside the vocabulary of 300 tokens",
    ),
    "add_bos_token the string no": (
        set_key("tokenizer.ggml.add_bos_token", "add_string", "no"),
        r"tokenizer.ggml.add_bos_token has the wrong type or value \(STRING; it must be true or false\)",
    ),
    "a merge without a space": (
        set_array("tokenizer.ggml.merges", lambda merges: [*merges[:3], merges[3].replace(" ", ""), *merges[4:]]),
        r"GGUF metadata tokenizer.ggml.merges\[3\] '.*' is not two tokens joined by a space",
    ),
    "chat template a number": (
        lambda w: w.add_uint32("tokenizer.chat_template", 3),
        r"tokenizer.chat_template has the wrong type or value \(UINT32; it must be a string\)",
    ),
}


@pytest.mark.parametrize("name", list(BAD_GGUF_FILES))
def test_bad_gguf_is_one_line_naming_the_file(name, tmp_path, tokenizer):
    edit, message = BAD_GGUF_FILES[name]
    path = write_gguf(tmp_path / "bad.gguf", tokenizer, edit=edit)
    with pytest.raises(ValueError) as info:
        convert_gguf(path, tmp_path / "out")
    text = str(info.value)
    assert str(path) in text and len(text.splitlines()) == 1, text
    assert re.search(message, text), text
    assert not (tmp_path / "out").exists()


def test_q4_blocks_become_int4_groups_of_32_without_a_second_rounding(tmp_path, tokenizer):
    """Layers whose every source tensor is Q4_0 or Q4_1 (layer 0's w13, layer 1's w2) keep gguf-py's dequantized
    values exactly; the others are quantized from float like any converted weight."""
    path = write_gguf(tmp_path / "tiny.gguf", tokenizer)
    convert_gguf(path, tmp_path / "float")
    convert_gguf(path, tmp_path / "int4", quantization=QuantConfig("int4", 32))
    floats, quantized = (torch.load(tmp_path / d / "model.pth", weights_only=True) for d in ("float", "int4"))

    def dequantized(prefix):
        return dequantize_int4(*(quantized[f"{prefix}.{s}"] for s in ("weight", "scales", "zeros")), 32)

    for prefix in ("layers.0.feed_forward.w13", "layers.1.feed_forward.w2"):
        reference = floats[f"{prefix}.weight"]
        torch.testing.assert_close(dequantized(prefix), reference, rtol=0, atol=1e-6)
    for prefix in ("layers.0.attention.wqkv", "layers.1.attention.wo", "layers.1.feed_forward.w13"):
        expected = quantize_int4(floats[f"{prefix}.weight"], 32, torch.float32)
        got = tuple(quantized[f"{prefix}.{suffix}"] for suffix in ("weight", "scales", "zeros"))
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    convert_gguf(path, tmp_path / "g64", quantization=QuantConfig("int4", 64))  # another group: from float
    g64 = torch.load(tmp_path / "g64" / "model.pth", weights_only=True)
    expected = quantize_int4(floats["layers.1.feed_forward.w2.weight"], 64, torch.float32)
    assert torch.equal(g64["layers.1.feed_forward.w2.zeros"], expected[2])


def test_a_q8_0_tied_table_becomes_int8_groups_of_32_without_a_second_rounding(tmp_path, tokenizer):
    """The tied embedding table, Q8_0 in the file, quantized in place (``quantization.embeddings``): in groups of
    32 it keeps gguf-py's dequantized values exactly; in groups of 64 it is quantized from float."""
    path = write_gguf(tmp_path / "tied.gguf", tokenizer, tied=True)
    convert_gguf(path, tmp_path / "float")
    table = torch.load(tmp_path / "float" / "model.pth", weights_only=True)["tok_embeddings.weight"]
    for group in (32, 64):
        quant = QuantConfig("int4", 32, embeddings=EmbeddingQuant("int8", group))
        convert_gguf(path, tmp_path / f"g{group}", quantization=quant)
        state = torch.load(tmp_path / f"g{group}" / "model.pth", weights_only=True)
        got = state["tok_embeddings.weight"], state["tok_embeddings.scales"]
        if group == 32:
            assert torch.equal(dequantize_int8(*got, 32), table)
        else:
            assert all(torch.equal(a, b) for a, b in zip(got, quantize_int8(table, torch.float32, 64), strict=True))
