"""llama.cpp's rows of the decode benchmark: the weight bytes they count, read against the arrays a tiny GGUF was
written from; the run's sampling on the command line and in the summary; and, where ``llama-cpp-python`` is
importable, the real library requantizing a tiny Q4_1 GGUF and decoding it as our engine does."""

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize
from test_convert_gguf import add_random_tensor, layer_shapes, llama_writer, write_out
from tiny import one_torch_thread, our_greedy, train_bpe_tokenizer

from gpt_fast.bench import llama_cpp_peer
from gpt_fast.bench.decode import GREEDY, run_benchmark
from gpt_fast.bench.llama_cpp_peer import (
    LlamaCppDecoder,
    form_name,
    gguf_bytes_per_token,
    llama_cpp_builders,
    llama_cpp_version,
    requantized,
)
from gpt_fast.bench.options import DecodeBenchOptions
from gpt_fast.convert.gguf_file import convert_gguf
from gpt_fast.engine.engine import Engine
from gpt_fast.model.shapes import get_shape

DIM, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 2, 128, 2
needs_llama_cpp = pytest.mark.skipif(llama_cpp_version() is None, reason="llama-cpp-python is not importable")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_bpe_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300)


def write_q4_1_gguf(path, tokenizer, tied=True, seed=0):
    """A tiny llama GGUF shaped as the default model's file: Q4_1 layers, a Q8_0 embedding table (also the output
    projection when ``tied``, else a Q8_0 output beside it), F32 norms. Returns the path and the encoded arrays."""
    rng = np.random.default_rng(seed)
    vocab = tokenizer.get_vocab_size()
    writer = llama_writer(path, tokenizer, sizes=(DIM, HEADS, KV_HEADS, INTER, LAYERS), context=128)
    arrays = {}

    def tensor(name, shape, qtype):
        arrays[name] = add_random_tensor(writer, rng, name, shape, qtype, HEADS, KV_HEADS)

    tensor("token_embd.weight", (vocab, DIM), Q.Q8_0)
    for layer in range(LAYERS):
        for part, shape in layer_shapes(DIM, HEADS, KV_HEADS, INTER).items():
            tensor(f"blk.{layer}.{part}.weight", shape, Q.Q4_1)
        tensor(f"blk.{layer}.attn_norm.weight", (DIM,), Q.F32)
        tensor(f"blk.{layer}.ffn_norm.weight", (DIM,), Q.F32)
    tensor("output_norm.weight", (DIM,), Q.F32)
    if not tied:
        tensor("output.weight", (vocab, DIM), Q.Q8_0)
    return write_out(writer, path), arrays


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_weight_bytes_are_the_arrays_a_step_reads(tmp_path, tokenizer, tied):
    """Every array written, but an embedding table that is not the output projection (a step reads one row)."""
    path, arrays = write_q4_1_gguf(tmp_path / "tiny.gguf", tokenizer, tied=tied)
    expected = sum(a.nbytes for a in arrays.values()) - (0 if tied else arrays["token_embd.weight"].nbytes)
    assert gguf_bytes_per_token(path) == expected


def test_requantized_files_are_named_by_form():
    assert form_name("Q8_0", "SmolLM2-135M-Instruct.Q4_1") == "SmolLM2-135M-Instruct.Q8_0.gguf"


def test_greedy_reaches_the_options_and_every_row(capsys):
    from gpt_fast.cli.main import main

    assert DecodeBenchOptions().greedy is False
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "decode", "--help"])
    assert exit_info.value.code == 0 and "--greedy" in capsys.readouterr().out
    lines = []
    settings = {"mode": "none", "dtype": torch.float32, "prompt_tokens": 5, "new_tokens": 4, "ttft_tokens": 8}
    with one_torch_thread():
        rows = run_benchmark(
            "tiny", torch.device("cpu"), **settings, repeats=1, peers=True, greedy=True, write=lines.append
        )
    assert [r.name.split()[0] for r in rows] == ["gpt-fast", "transformers", "transformers"]
    assert rows[1].name.endswith(" static cache")  # transformers compiles its static cache on a GPU only
    summary = lines[-2]
    assert summary.startswith("tiny, CPU, CPU threads: 1, ") and ", TTFT prompt 8, greedy; " in summary, summary
    skipped = (
        "llama-cpp-python is not importable: llama.cpp rows skipped"
        if llama_cpp_version() is None
        else "llama.cpp rows skipped: they run the default model, whose shape is smollm2-135m, not tiny"
    )
    assert skipped in lines


def test_no_llama_cpp_rows_off_the_cpu():
    lines = []
    builders = llama_cpp_builders(
        "smollm2-135m", get_shape("smollm2-135m"), torch.device("meta"), 64, GREEDY, lines.append
    )
    assert builders == {} and lines == []


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("gguf")
    return write_q4_1_gguf(folder / "tiny.Q4_1.gguf", tokenizer)[0]


@needs_llama_cpp
@pytest.mark.parametrize("form, qtype", [("Q8_0", Q.Q8_0), ("F16", Q.F16)])
def test_llama_cpp_requantizes_the_q4_1_file(tmp_path, tiny_q4_1, form, qtype):
    """llama.cpp's quantize API makes each form from the Q4_1 file: every matrix in that type (norms stay F32), its
    values the Q4_1 values to that type's precision (read with gguf's own reader and dequantizer); made once."""
    path = requantized(tiny_q4_1, form, tmp_path / "cache", threads=1)
    assert path == tmp_path / "cache" / f"tiny.{form}.gguf" and os.listdir(path.parent) == [path.name]
    source = {t.name: t for t in GGUFReader(tiny_q4_1).tensors}
    made = {t.name: t for t in GGUFReader(path).tensors}
    assert made.keys() == source.keys()
    for name, tensor in made.items():
        if name.endswith("norm.weight"):
            assert tensor.tensor_type == Q.F32, name
            continue
        assert tensor.tensor_type == qtype, name
        before = dequantize(source[name].data, source[name].tensor_type)
        after = dequantize(tensor.data, tensor.tensor_type)
        scale = np.abs(before).max()
        assert np.abs(after - before).max() <= (scale / 127 if qtype == Q.Q8_0 else scale / 1024), name
    made_at = path.stat().st_mtime_ns
    assert requantized(tiny_q4_1, form, tmp_path / "cache", threads=1).stat().st_mtime_ns == made_at


@needs_llama_cpp
def test_llama_cpp_decodes_as_our_engine_does(tmp_path, tiny_q4_1):
    """Greedy tokens of the F16 file from llama.cpp and from our engine on the same file converted; every run from
    an empty cache, so twice the same."""
    path = requantized(tiny_q4_1, "F16", tmp_path / "cache", threads=1)
    convert_gguf(path, tmp_path / "ours")
    prompt = [5, 17, 42, 99, 7]
    decoder = LlamaCppDecoder(path, threads=1, context_tokens=64, sampling=GREEDY)
    theirs = decoder.generate(prompt, 12)
    assert len(theirs) == 12 and decoder.generate(prompt, 12) == theirs
    with one_torch_thread():
        assert our_greedy(Engine.load(tmp_path / "ours", device="cpu", dtype="float32"), prompt, 12) == theirs


@needs_llama_cpp
def test_llama_cpp_rows_are_made_for_the_default_shape(tmp_path, monkeypatch, tiny_q4_1):
    """The rows' names, one per form, built on the file the default model's finder gives (here the tiny one)."""
    from gpt_fast.convert.gguf_file import model_config_from_gguf, open_gguf

    monkeypatch.setattr(llama_cpp_peer, "default_gguf", lambda: tiny_q4_1)
    monkeypatch.setenv("GPT_FAST_CACHE", str(tmp_path))
    shape = model_config_from_gguf(open_gguf(tiny_q4_1))
    lines = []
    with one_torch_thread():
        builders = llama_cpp_builders("smollm2-135m", shape, torch.device("cpu"), 64, GREEDY, lines.append)
        assert [name.rsplit(" ", 1)[1] for name in builders] == ["Q4_1", "Q8_0", "F16"]
        assert all(name.startswith(f"llama.cpp (llama-cpp-python {llama_cpp_version()}) ") for name in builders)
        (run, _), bytes_per_token = next(iter(builders.values()))()
        run([1, 2, 3], 4)
    assert bytes_per_token == gguf_bytes_per_token(tiny_q4_1)
    assert [line.split(":")[0] for line in lines] == ["llama.cpp Q4_1", "llama.cpp Q8_0", "llama.cpp F16"]
