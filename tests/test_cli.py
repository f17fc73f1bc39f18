"""`gpt-fast` end to end on a tiny random checkpoint: the figures, the trace, the JSON, and every bad input."""

import json
import os
import subprocess
import sys

import pytest
import torch

from gpt_fast.cli import main
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.interactive import chat_loop
from gpt_fast.runner import Engine, EngineOptions
from gpt_fast.sampling import SamplingConfig
from gpt_fast.shapes import get_shape


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny"), dtype=torch.float32, seed=1)


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def generate_args(checkpoint, *extra):
    return ["generate", "--checkpoint_path", str(checkpoint), "--max_new_tokens", "12", "--num_samples", "2", *extra]


def test_generate_prints_the_figures(checkpoint, capsys):
    code, out, err = run(generate_args(checkpoint, "--prompt", "def quicksort(arr):", "--seed", "3"), capsys)
    assert code == 0, err
    for line in (
        "Using device=cpu",
        "Time to load model:",
        "def quicksort(arr):",
        "Sample 2/2: 12 tokens",
        "Bandwidth achieved (samples 2-2):",
        "Average tokens/sec (samples 2-2):",
        "Average time to first token",
        "Memory used:",
    ):
        assert line in out
    assert "Compilation time" not in out


def test_metrics_json_holds_ids_and_consistent_figures(checkpoint, tmp_path, capsys):
    path = tmp_path / "metrics.json"
    code, _, err = run(
        generate_args(
            checkpoint, "--prompt", "hello", "--ignore_eos", "--batch_size", "3", "--metrics_json", str(path)
        ),
        capsys,
    )
    assert code == 0, err
    metrics = json.loads(path.read_text())
    assert metrics["prompt_ids"] == [256, *b"hello"]  # BOS, then one byte-level token per byte
    assert metrics["batch_size"] == 3 and len(metrics["samples"]) == 2
    for sample in metrics["samples"]:
        assert [len(row) for row in sample["generated_ids"]] == [12, 12, 12]
        assert sample["tokens_per_sec"] == pytest.approx(12 / sample["seconds"])
        assert sample["bandwidth_gbps"] == pytest.approx(
            metrics["weight_bytes_per_token"] * sample["tokens_per_sec"] / 1e9
        )
        assert 0 < sample["ttft_seconds"] < sample["seconds"]
    assert metrics["samples"][0]["warmup"] and not metrics["samples"][1]["warmup"]
    assert metrics["average_tokens_per_sec"] == pytest.approx(metrics["samples"][1]["tokens_per_sec"])


def test_same_seed_same_text(checkpoint, tmp_path, capsys):
    texts = []
    for name in ("a", "b"):
        run(
            generate_args(checkpoint, "--seed", "11", "--temperature", "1.0", "--metrics_json", str(tmp_path / name)),
            capsys,
        )
        texts.append([s["generated_ids"] for s in json.loads((tmp_path / name).read_text())["samples"]])
    assert texts[0] == texts[1]


def test_profile_writes_a_perfetto_trace_with_the_decode_ops(checkpoint, tmp_path, capsys):
    prefix = tmp_path / "trace_compile_none"
    code, out, err = run(generate_args(checkpoint, "--profile", str(prefix)), capsys)
    assert code == 0, err
    trace = json.loads((tmp_path / "trace_compile_none.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"gpt_fast::decode", "gpt_fast::prefill", "aten::mm", "aten::index_copy_"} <= names
    assert f"Trace written to {prefix}.json" in out
    assert "decode: 11 tokens" in out
    code, out, _ = run(["trace-summary", str(tmp_path / "trace_compile_none.json"), "--json"], capsys)
    assert code == 0 and json.loads(out)["tokens"] == 11


def test_dashed_spellings(checkpoint, capsys):
    code, out, err = run(
        [
            "generate",
            "--checkpoint-path",
            str(checkpoint),
            "--max-new-tokens",
            "3",
            "--num-samples",
            "1",
            "--top-k",
            "5",
            "--top-p",
            "0.9",
        ],
        capsys,
    )
    assert code == 0, err
    assert "Sample 1/1: 3 tokens" in out


def test_module_entry_point(checkpoint):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpt_fast",
            "generate",
            "--checkpoint_path",
            str(checkpoint),
            "--max_new_tokens",
            "2",
            "--num_samples",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Average tokens/sec" in result.stdout


BAD_INPUTS = {
    "empty prompt": (["--prompt", ""], "--prompt is empty"),
    "prompt not UTF-8": (["--prompt", "ab\udcffc"], "the prompt is not valid UTF-8: byte 0xFF at character 2"),
    "no new tokens": (["--max_new_tokens", "0"], "--max_new_tokens must be >= 1"),
    "negative temperature": (["--temperature", "-0.5"], "temperature must be a finite number >= 0"),
    "nan temperature": (["--temperature", "nan"], "temperature must be a finite number >= 0"),
    "inf temperature": (["--temperature", "inf"], "temperature must be a finite number >= 0"),
    "top_k below one": (["--top_k", "0"], "top_k must be an integer >= 1"),
    "top_p zero": (["--top_p", "0"], r"top_p must be in \(0, 1\]"),
    "top_p above one": (["--top_p", "1.01"], r"top_p must be in \(0, 1\]"),
    "batch below one": (["--batch_size", "0"], "--batch_size must be >= 1"),
    "samples below one": (["--num_samples", "0"], "--num_samples must be >= 1"),
    "unknown compile mode": (
        ["--compile", "turbo"],
        "--compile 'turbo' is not one of none, default, reduce-overhead, max-autotune",
    ),
    "too long for the context": (["--max_new_tokens", "600"], "exceeds the model's context of 512 tokens"),
    "profile folder missing": (
        ["--profile", "/nonexistent-folder/trace"],
        "--profile: folder /nonexistent-folder does not exist",
    ),
    "metrics folder missing": (
        ["--metrics_json", "/nonexistent-folder/m.json"],
        "--metrics_json: folder /nonexistent-folder does not exist",
    ),
    "unknown dtype": (["--dtype", "int8"], "--dtype 'int8' is not one of auto, float32, bfloat16, float16"),
    "not an integer": (["--max_new_tokens", "many"], "'many' is not a valid integer"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_non_zero(name, checkpoint, capsys, tmp_path):
    args, message = BAD_INPUTS[name]
    code, out, err = run(
        ["generate", "--checkpoint_path", str(checkpoint), "--metrics_json", str(tmp_path / "m.json"), *args], capsys
    )
    assert code != 0
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert __import__("re").search(message, err), err
    assert "Loading model" not in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_cuda_without_a_gpu(checkpoint, capsys):
    code, _, err = run(generate_args(checkpoint, "--device", "cuda"), capsys)
    assert code == 1 and "no CUDA or ROCm GPU is available" in err


def test_profile_folder_not_writable(checkpoint, capsys, tmp_path, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real_access(path, mode)
    )
    code, out, err = run(generate_args(checkpoint, "--profile", str(tmp_path / "trace")), capsys)
    assert code == 1 and err.strip() == f"error: --profile: folder {tmp_path} is not writable"
    assert "Loading model" not in out


@pytest.mark.parametrize(
    "remove, message",
    [
        ("config.json", "missing .*config.json"),
        ("tokenizer.json", "tokenizer file not found"),
        ("model.pth", "missing weights file"),
    ],
)
def test_incomplete_checkpoint(checkpoint, tmp_path, capsys, remove, message):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for path in checkpoint.parent.iterdir():
        if path.name != remove:
            (folder / path.name).write_bytes(path.read_bytes())
    code, _, err = run(generate_args(folder), capsys)
    assert code == 1 and __import__("re").search(message, err), err


def test_missing_checkpoint(tmp_path, capsys):
    code, _, err = run(generate_args(tmp_path / "nothing" / "model.pth"), capsys)
    assert code == 1 and err.strip() == f"error: checkpoint not found: {tmp_path / 'nothing' / 'model.pth'}"


def test_chat_without_a_template(checkpoint, capsys):
    code, _, err = run(generate_args(checkpoint, "--chat"), capsys)
    assert code == 1 and "no chat template" in err


def test_chat_loop_keeps_the_conversation(smollm2_gguf, tmp_path):
    from gpt_fast.convert.gguf_file import convert_gguf

    convert_gguf(smollm2_gguf, tmp_path / "smol")
    written = []
    engine = Engine(EngineOptions(tmp_path / "smol", device="cpu"), written.append)
    engine.load()
    turns = iter(["What is the capital of France?", "And of Italy?", "/exit"])
    seen = []
    original = engine.chat_ids
    engine.chat_ids = lambda messages: seen.append([dict(m) for m in messages]) or original(messages)
    chat_loop(engine, SamplingConfig(temperature=0), 30, lambda prompt: next(turns))
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]
    assert "Paris" in seen[1][1]["content"]
    assert "Rome" in "".join(written)


def test_random_checkpoint_and_convert_commands(tmp_path, capsys):
    code, out, err = run(
        ["random-checkpoint", "tiny", "--output_dir", str(tmp_path / "r"), "--dtype", "float32"], capsys
    )
    assert code == 0 and (tmp_path / "r" / "model.pth").is_file(), err
    code, _, err = run(["random-checkpoint", "huge", "--output_dir", str(tmp_path / "h")], capsys)
    assert code == 1 and "known shapes: llama-2-7b, llama-3-8b, smollm2-135m, tiny" in err
    code, _, err = run(["convert", str(tmp_path / "r" / "model.pth")], capsys)
    assert code == 1 and "neither a Hugging Face checkpoint folder nor a GGUF file" in err
