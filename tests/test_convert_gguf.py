"""GGUF file -> our checkpoint: a synthetic llama GGUF holding every supported tensor type, compared with
transformers loading the same file; and broken files."""

import json

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from tiny import train_bpe_tokenizer

from gpt_fast.convert.gguf_file import convert_gguf
from gpt_fast.engine import Engine

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


def write_gguf(path, tokenizer, *, architecture="llama", tied=False, seed=0, rope_freqs=None):
    rng = np.random.default_rng(seed)
    vocab = tokenizer.get_vocab_size()
    writer = GGUFWriter(str(path), architecture)
    writer.add_context_length(512)
    writer.add_embedding_length(DIM)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = [tokenizer.id_to_token(i) for i in range(vocab)]
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in tokens])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.token_to_id("<s>"))
    writer.add_eos_token_id(tokenizer.token_to_id("</s>"))
    writer.add_add_bos_token(True)

    def tensor(name, shape, qtype):
        data = rng.normal(0, 0.25, size=shape).astype(np.float32)
        if name.endswith("norm.weight"):
            data = 1 + 0.1 * data
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            data = llama_cpp_permute(data, HEADS if "attn_q" in name else KV_HEADS)
        encoded = encode(data, qtype, rng)
        writer.add_tensor(name, encoded, raw_shape=encoded.shape, raw_dtype=qtype)

    tensor("token_embd.weight", (vocab, DIM), Q.Q8_0)
    for layer, types in enumerate(LAYER_TYPES):
        head_dim = DIM // HEADS
        shapes = {
            "attn_q": (DIM, DIM),
            "attn_k": (KV_HEADS * head_dim, DIM),
            "attn_v": (KV_HEADS * head_dim, DIM),
            "attn_output": (DIM, DIM),
            "ffn_gate": (INTER, DIM),
            "ffn_up": (INTER, DIM),
            "ffn_down": (DIM, INTER),
        }
        for part, qtype in types.items():
            tensor(f"blk.{layer}.{part}.weight", shapes[part], qtype)
        tensor(f"blk.{layer}.attn_norm.weight", (DIM,), Q.F32)
        tensor(f"blk.{layer}.ffn_norm.weight", (DIM,), Q.F32)
    tensor("output_norm.weight", (DIM,), Q.F32)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if not tied:
        tensor("output.weight", (vocab, DIM), Q.Q6_K)
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


def test_unsupported_architecture(tmp_path, tokenizer):
    path = write_gguf(tmp_path / "other.gguf", tokenizer, architecture="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture gpt2"):
        convert_gguf(path, tmp_path / "out")


def test_the_folder_holding_the_gguf_is_not_written_into(tmp_path, tokenizer):
    path = write_gguf(tmp_path / "tiny.gguf", tokenizer)
    with pytest.raises(FileExistsError, match=f"refusing to write into {tmp_path}: it holds tiny.gguf"):
        convert_gguf(path, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]
