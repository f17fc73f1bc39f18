"""`gpt-fast` end to end on a tiny random checkpoint: the figures, the trace, the JSON, and every bad input."""

import io
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_convert_gguf import set_key, write_gguf
from tiny import save_hf_llama, train_bpe_tokenizer

from gpt_fast import __version__
from gpt_fast.cli.main import main
from gpt_fast.convert.hf_config import hf_config_dict
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.kernels import cpu_gemv
from gpt_fast.model.shapes import SHAPES, get_shape


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny float32 checkpoint; our C++ kernels built first where they build, so that a first build's note on
    standard error (or the wait for another test process's build) is not part of a command's output."""
    if cpu_gemv.cpu_kernels_usable():
        cpu_gemv.load_cpu_kernels()
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
        "Using device=cpu (CPU, ",
        "Sampling: temperature 0.8 (default), top_k 200 (default), top_p 1 (default)\n",
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


def test_metrics_json_to_dev_stdout_follows_the_figures(checkpoint, capsys):
    """``-`` keeps standard output for the JSON alone (test_metrics_to_standard_output); /dev/stdout is a file
    the user named, written through after the figures."""
    code, out, err = run(generate_args(checkpoint, "--metrics_json", "/dev/stdout"), capsys)
    assert code == 0, err
    figures, metrics = out.split("\n{\n", 1)
    assert "Average tokens/sec" in figures and len(json.loads("{\n" + metrics)["samples"]) == 2
    assert Path("/dev/stdout").is_symlink()


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
    "unknown quantized kernel": (
        ["--quant_kernel", "fast"],
        "--quant_kernel 'fast' is not one of auto, triton, gemlite, cpp, cpp-q8, aten, dequant",
    ),
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


def test_random_checkpoint_and_convert_commands(tmp_path, capsys):
    code, out, err = run(
        ["random-checkpoint", "tiny", "--output_dir", str(tmp_path / "r"), "--dtype", "float32"], capsys
    )
    assert code == 0 and (tmp_path / "r" / "model.pth").is_file(), err
    code, _, err = run(["random-checkpoint", "huge", "--output_dir", str(tmp_path / "h")], capsys)
    assert code == 1 and f"'huge' is not one of {', '.join(SHAPES)}" in err and "mixtral-8x7b" in err
    assert not (tmp_path / "h").exists()
    code, _, err = run(["convert", str(tmp_path / "r" / "model.pth")], capsys)
    assert code == 1 and "neither a Hugging Face checkpoint folder nor a GGUF file" in err


def test_version(capsys):
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out.strip() == f"gpt-fast {__version__}"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_lists_the_choices_whole(command, capsys):
    code, out, _ = run([command, "--help"], capsys)
    assert code == 0
    assert "[none|default|reduce-overhead|max-autotune]" in out
    assert "[auto|float32|bfloat16|float16]" in out and "[cpu|cuda|cuda:N]" in out


@pytest.mark.parametrize(
    "profile, written",
    [("run", "run.json"), ("run.json", "run.json"), ("folder/", "folder/trace.json"), (".", "trace.json")],
)
def test_profile_path_forms(profile, written, checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(generate_args(checkpoint, "--profile", profile, "--max_new_tokens", "3"), capsys)
    assert code == 0, err
    assert (tmp_path / written).is_file() and f"Trace written to {Path(written)}" in out.replace("./", "")
    assert not list(tmp_path.rglob("*.json.json"))


def test_profiled_sample_is_reported_apart(checkpoint, tmp_path, capsys):
    metrics_path = tmp_path / "m.json"
    args = generate_args(checkpoint, "--profile", str(tmp_path / "t"), "--num_samples", "3", "--ignore_eos")
    code, out, err = run([*args, "--metrics_json", str(metrics_path)], capsys)
    assert code == 0, err
    metrics = json.loads(metrics_path.read_text())
    assert [(s["warmup"], s["profiled"]) for s in metrics["samples"]] == [
        (True, False),
        (False, False),
        (False, False),
        (False, True),
    ]
    timed = metrics["samples"][1:3]
    assert metrics["average_tokens_per_sec"] == pytest.approx(sum(s["tokens_per_sec"] for s in timed) / 2)
    assert metrics["averaged_over"] == "samples 2-3"
    assert "Profiled sample: 12 tokens" in out and "(not in the averages" in out
    assert "Average tokens/sec (samples 2-3):" in out
    assert metrics["trace"]["tokens"] == 11


def test_a_single_sample_is_labelled_warm_up(checkpoint, tmp_path, capsys):
    code, out, err = run(generate_args(checkpoint, "--num_samples", "1"), capsys)
    assert code == 0, err
    assert "Sample 1/1: 12 tokens" in out and "(warm-up)" in out
    assert "Average tokens/sec (warm-up, includes one-time set-up):" in out


def test_metrics_to_standard_output(checkpoint, capsys):
    code, out, err = run(generate_args(checkpoint, "--metrics_json", "-", "--num_samples", "1"), capsys)
    assert code == 0, err
    assert json.loads(out)["samples"][0]["new_tokens"] >= 1  # stdout holds the JSON alone
    assert "Average tokens/sec" in err


def test_regional_compile_is_said_and_recorded(checkpoint, capsys):
    extra = ("--compile", "default", "--regional_compile", "--metrics_json", "-", "--num_samples", "1")
    code, out, err = run(generate_args(checkpoint, *extra), capsys)
    assert code == 0, err
    metrics = json.loads(out)
    assert metrics["regional_compile"] is True and metrics["compile"] == "default"
    assert "compile=default (regional: one layer compiled and reused)" in err
    assert metrics["kernel_tuning"] == "coordinate-descent"


def test_heuristic_kernel_tuning_is_said_and_recorded(checkpoint, capsys):
    extra = ("--compile", "default", "--kernel_tuning", "heuristic", "--metrics_json", "-", "--num_samples", "1")
    code, out, err = run(generate_args(checkpoint, *extra), capsys)
    assert code == 0, err
    assert json.loads(out)["kernel_tuning"] == "heuristic"
    assert "compile=default (kernels: inductor's heuristic configurations, not tuned)" in err
    code, out, err = run(generate_args(checkpoint, "--metrics_json", "-", "--num_samples", "1"), capsys)
    assert code == 0 and json.loads(out)["kernel_tuning"] is None  # eager: no kernels generated


def test_prompt_from_standard_input_and_from_a_file(checkpoint, tmp_path, capsys, monkeypatch):
    prompt = "def f(x):\n    return x\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(prompt.encode())))
    metrics = tmp_path / "stdin.json"
    code, _, err = run(generate_args(checkpoint, "--prompt", "-", "--metrics_json", str(metrics)), capsys)
    assert code == 0, err
    assert json.loads(metrics.read_text())["prompt_ids"] == [256, *prompt.removesuffix("\n").encode()]  # echo's
    (tmp_path / "p.txt").write_text(prompt)
    code, _, err = run(
        generate_args(checkpoint, "--prompt_file", str(tmp_path / "p.txt"), "--metrics_json", str(metrics)), capsys
    )
    assert code == 0, err
    assert json.loads(metrics.read_text())["prompt_ids"] == [256, *prompt.encode()]


MORE_BAD_INPUTS = {
    "seed below zero": (["--seed", "-1"], r"--seed must be in 0..2\*\*64-1"),
    "seed too large": (["--seed", str(2**64)], r"--seed must be in 0..2\*\*64-1"),
    "system without chat": (["--system", "be brief"], "--system goes with --chat"),
    "invalid UTF-8 prompt": (
        ["--prompt", b"caf\xff".decode("utf-8", "surrogateescape")],
        "the prompt is not valid UTF-8: byte 0xFF at character 3",
    ),
    "prompt and prompt file": (["--prompt", "x", "--prompt_file", "p.txt"], "give --prompt or --prompt_file, not both"),
    "metrics into a folder": (["--metrics_json", "."], "--metrics_json: . is a folder"),
    # /proc refuses new files even to root, whom os.access allows everything
    "metrics under /proc": (
        ["--metrics_json", "/proc/m.json"],
        r"--metrics_json: (cannot write in folder /proc \(|folder /proc is not writable)",
    ),
    "profile under /proc": (
        ["--profile", "/proc/t.json"],
        r"--profile: (cannot write in folder /proc \(|folder /proc is not writable)",
    ),
    "profile folder under /proc": (
        ["--profile", "/proc/traces/"],
        r"--profile: (cannot create folder /proc/traces \(|--profile /proc/traces is not writable)",
    ),
    "profile empty": (["--profile", ""], "--profile is empty: give a trace file or a folder"),
    "unknown device": (["--device", "tpu"], "--device 'tpu' is not a device"),
    "unsupported device": (["--device", "meta"], "--device 'meta' is not supported"),
    "chat without a template": (["--chat"], "no chat template"),
    "several prompts and copies": (["--prompt", "a", "--prompt", "b", "--batch_size", "2"], "--batch_size copies one"),
    "a prompt without --prompt": (
        ["Once upon"],
        "unexpected argument 'Once upon': give the prompt with --prompt 'Once upon'",
    ),
    "a missing prompt file": (["--prompt_file", "nothing.txt"], "^error: missing --prompt_file nothing.txt$"),
    "a missing prompts file": (["--prompts_file", "nothing.txt"], "^error: missing --prompts_file nothing.txt$"),
    "a batch beyond the memory": (["--batch_size", str(10**10)], "--batch_size 10000000000: the KV cache alone needs"),
    "several prompts and a file": (["--prompt", "a", "--prompt", "b", "--prompt_file", "p.txt"], "not both"),
    "several prompts, one from stdin": (["--prompt", "-", "--prompt", "b"], "--prompt - reads one prompt"),
    "prompts file and a prompt": (["--prompts_file", "p.txt", "--prompt", "a"], "give --prompts_file alone"),
    "several prompts, speculated": (["--prompt", "a", "--prompt", "b", "--prompt_lookup", "2"], "takes one prompt"),
    "several prompts, one too long": (["--prompt", "a", "--prompt", "b" * 600], "exceeds the model's context"),
    "speculate_k alone": (["--speculate_k", "3"], "--speculate_k goes with --draft_checkpoint_path or --prompt_lookup"),
    "two drafters": (["--prompt_lookup", "2", "--draft_checkpoint_path", "x"], "takes one drafter"),
    "prompt lookup of zero": (["--prompt_lookup", "0"], r"--prompt_lookup must be an integer in 1\.\.16, got 0"),
    "speculate_k too large": (["--prompt_lookup", "2", "--speculate_k", "99"], r"--speculate_k must be an integer"),
    "draft checkpoint missing": (["--draft_checkpoint_path", "/nonexistent/d"], "checkpoint not found: /nonexistent/d"),
    "batch invariance with an AOT package": (
        ["--batch_invariant", "--compile", "default", "--aot_precompile"],
        "--batch_invariant does not combine with --aot_precompile",
    ),
}


@pytest.mark.parametrize("name", list(MORE_BAD_INPUTS))
def test_more_bad_input_is_one_line_before_loading(name, checkpoint, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, message = MORE_BAD_INPUTS[name]
    code, out, err = run(["generate", "--checkpoint_path", str(checkpoint), *args], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert re.search(message, err), err
    assert "Loading model" not in out and list(tmp_path.iterdir()) == []


def test_several_prompts_are_generated_together(checkpoint, tmp_path, capsys):
    """Repeated --prompt, or --prompts_file: each prompt's greedy text is what it gets alone."""
    prompts = ["def quicksort(arr):", "Hello", "1, 2, 3,"]
    alone = []
    for prompt in prompts:
        metrics = tmp_path / "alone.json"
        run(generate_args(checkpoint, "--prompt", prompt, "--temperature", "0", "--metrics_json", str(metrics)), capsys)
        alone.append(json.loads(metrics.read_text())["samples"][-1]["generated_ids"][0])
    metrics = tmp_path / "together.json"
    argv = generate_args(checkpoint, "--temperature", "0", "--metrics_json", str(metrics))
    code, out, err = run([*argv, *(arg for prompt in prompts for arg in ("--prompt", prompt))], capsys)
    assert code == 0, err
    together = json.loads(metrics.read_text())
    assert together["samples"][-1]["generated_ids"] == alone
    assert together["prompt_ids"] == [[256, *prompt.encode()] for prompt in prompts]
    assert all(f"[{row}] {prompt}" in out for row, prompt in enumerate(prompts))
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n\n")
    argv = generate_args(checkpoint, "--temperature", "0", "--prompts_file", str(tmp_path / "prompts.txt"))
    code, _, err = run([*argv, "--metrics_json", str(metrics)], capsys)
    assert code == 0, err
    assert json.loads(metrics.read_text())["samples"][-1]["generated_ids"] == alone


def test_an_empty_prompts_file(checkpoint, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("\n \n")
    code, _, err = run(generate_args(checkpoint, "--prompts_file", str(tmp_path / "p.txt")), capsys)
    assert code == 1 and f"--prompts_file {tmp_path / 'p.txt'} holds no prompt" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--max_batch", "0"], "--max_batch must be an integer in 1..64"),
        (["--max_queue", "-1"], "--max_queue must be an integer >= 0"),
        (["--max_seq_length", "600"], "--max_seq_length 600 exceeds the model's context of 512"),
        (["--api_key", " "], "--api_key is empty"),
        (["--compile", "fast"], "--compile 'fast' is not one of"),
        (["--host", "no.such.host.invalid"], "cannot listen on no.such.host.invalid:"),
    ],
)
def test_serve_refuses_before_loading(args, message, checkpoint, capsys):
    code, out, err = run(["serve", "--checkpoint_path", str(checkpoint), "--port", "0", *args], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and message in err, err
    assert "Time to load model" not in out


def test_serve_refuses_a_port_in_use(checkpoint, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = run(["serve", "--checkpoint_path", str(checkpoint), "--port", str(port)], capsys)
    assert code == 1 and f"error: cannot listen on 127.0.0.1:{port}:" in err and "Time to load model" not in out


@pytest.mark.parametrize("invariant", [[], ["--batch_invariant"]], ids=["usual", "batch-invariant"])
def test_speculative_generate_reports_acceptance_and_keeps_the_text(invariant, checkpoint, tmp_path, capsys):
    """Greedy: the same ids with prompt lookup as without; the figures in the report and in the JSON."""
    ids = {}
    for name, extra in (("plain", []), ("lookup", ["--prompt_lookup", "2", "--speculate_k", "3"])):
        path = tmp_path / f"{name}.json"
        args = ["--prompt", "abcabcabc", "--temperature", "0", "--ignore_eos", "--metrics_json", str(path), *extra]
        args += invariant
        code, out, err = run(generate_args(checkpoint, *args), capsys)
        assert code == 0, err
        metrics = json.loads(path.read_text())
        ids[name] = [s["generated_ids"] for s in metrics["samples"]]
    assert ids["lookup"] == ids["plain"]
    assert "Speculative decoding: prompt lookup (n-grams up to 2), 3 tokens drafted per verify step" in out
    assert re.search(r"Speculative decoding \(samples 2-2\): prompt lookup .*, k=3: acceptance \d+\.\d%", out)
    assert metrics["batch_invariant"] == bool(invariant) and ("batch-invariant steps" in out) == bool(invariant)
    spec = metrics["speculative"]
    assert spec == metrics["samples"][1]["speculative"] and spec["k"] == 3 and spec["rounds"] > 0
    assert spec["tokens_per_step"] == pytest.approx(1 + spec["accepted"] / spec["rounds"])


def test_invalid_utf8_prompt_file(checkpoint, tmp_path, capsys):
    (tmp_path / "p.txt").write_bytes(b"caf\xe9")
    code, _, err = run(generate_args(checkpoint, "--prompt_file", str(tmp_path / "p.txt")), capsys)
    assert code == 1 and f"--prompt_file {tmp_path / 'p.txt'} is not valid UTF-8" in err


def test_checkpoint_named_org_slash_name(checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(checkpoint.parent, tmp_path / "checkpoints" / "acme" / "tiny")
    code, out, err = run(generate_args("acme/tiny", "--num_samples", "1"), capsys)
    assert code == 0, err
    code, _, err = run(generate_args("acme/missing"), capsys)
    assert code == 1 and "prepare it with: gpt-fast prepare acme/missing" in err


@pytest.mark.parametrize(
    "args, message",
    [([], "no chat template"), (["--max_new_tokens", "100000"], "exceeds the model's context")],
)
def test_chat_refuses_before_loading(args, message, checkpoint, smollm2_checkpoint, capsys):
    target = checkpoint if not args else smollm2_checkpoint
    code, out, err = run(["chat", "--checkpoint_path", str(target), *args], capsys)
    assert code == 1 and message in err and "Loading model" not in out


def test_chat_without_a_template_names_its_own_options(checkpoint, capsys):
    code, _, err = run(["chat", "--checkpoint_path", str(checkpoint)], capsys)
    assert code == 1 and "give chat a --checkpoint_path whose checkpoint has one" in err
    assert "--chat" not in err  # an option of generate, not of chat


def test_chat_with_a_seed_answers_the_same(smollm2_checkpoint, capsys, monkeypatch):
    answers = []
    for _ in range(2):
        monkeypatch.setattr(sys, "stdin", io.StringIO("Tell me a joke.\n/reset\n/exit\n"))
        argv = ["chat", "--checkpoint_path", str(smollm2_checkpoint), "--seed", "7", "--temperature", "1"]
        code, out, err = run([*argv, "--max_new_tokens", "12", "--device", "cpu"], capsys)
        assert code == 0, err
        assert "Sampling: temperature 1 (given), top_k 200 (default), top_p 1 (default)" in out
        assert "(a new conversation)" in out
        answers.append(out.split("Time to load model", 1)[1].split("\n", 1)[1])
    assert answers[0] == answers[1]
    code, _, err = run(["chat", "--checkpoint_path", str(smollm2_checkpoint), "--seed", "-1"], capsys)
    assert code == 1 and "--seed must be in 0..2**64-1" in err


def test_ctrl_c_during_generate_exits_130_and_writes_nothing(checkpoint, tmp_path):
    metrics = tmp_path / "m.json"
    script = (
        "import signal\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if it was ignored\n"
        "from gpt_fast.cli.main import main\n"
        f"main(['generate', '--checkpoint_path', {str(checkpoint)!r}, '--max_new_tokens', '400', '--num_samples',"
        f" '1000', '--ignore_eos', '--no_stream', '--metrics_json', {str(metrics)!r}])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while "Sample 1/" not in proc.stdout.readline():
        assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.strip().splitlines()[-1] == "error: interrupted"
    assert list(tmp_path.iterdir()) == []


def edit_config(edit):
    def apply(folder):
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))

    return apply


def poison_weights(folder):
    state = torch.load(folder / "model.pth", weights_only=True)
    state["norm.weight"][0] = float("nan")
    torch.save(state, folder / "model.pth")


def flip_a_weight_byte(folder):
    """One bit of one stored weight flipped in place: the archive's structure and sizes stay valid."""
    import zipfile

    with zipfile.ZipFile(folder / "model.pth") as archive:
        member = next(m for m in archive.infolist() if m.filename.endswith("/data/3"))
    data = bytearray((folder / "model.pth").read_bytes())
    name_length, extra_length = struct.unpack_from("<HH", data, member.header_offset + 26)
    data[member.header_offset + 30 + name_length + extra_length + 5] ^= 0x10
    (folder / "model.pth").write_bytes(bytes(data))


def hide_a_storage(folder):
    """norm.weight saved as a view of a storage a thousand times larger than itself."""
    state = torch.load(folder / "model.pth", weights_only=True)
    hidden = torch.zeros(state["norm.weight"].numel() * 1000)
    hidden[: state["norm.weight"].numel()] = state["norm.weight"]
    state["norm.weight"] = hidden[: state["norm.weight"].numel()]
    torch.save(state, folder / "model.pth")


def grow_tokenizer(folder):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens(["<one too many>"])
    tokenizer.save(str(folder / "tokenizer.json"))


# Edits of a copy of the tiny checkpoint -> what `gpt-fast generate`'s one error line says
HOSTILE_CHECKPOINTS = {
    "bool as a string": (
        edit_config(lambda c: c["model"].update(tie_embeddings="false")),
        r"config.json.model.tie_embeddings must be true or false, got 'false'",
    ),
    "ten million layers": (
        edit_config(lambda c: c["model"].update(n_layer=10**7)),
        r"model.pth holds \d+ bytes, config.json's model describes \d+ parameters",
    ),
    "infinite rope factor": (
        edit_config(lambda c: c["model"].update(rope_scaling={"kind": "linear", "factor": float("inf")})),
        r"rope_scaling.factor must be a finite number, got inf",
    ),
    "bos outside the vocabulary": (
        edit_config(lambda c: c["tokenizer"].update(bos_id=600)),
        r"tokenizer.bos_id = 600 is outside the model's vocabulary \(model.vocab_size = 512\)",
    ),
    "weights outside the folder": (
        edit_config(lambda c: c.update(weights="../model.pth")),
        r"weights must be a path inside the checkpoint folder",
    ),
    "text as weights": (
        lambda f: (f / "model.pth").write_text("weights\n" * 10**5),
        r"model.pth is not a torch.save archive",
    ),
    "a pipe as weights": (lambda f: (f / "model.pth").unlink() or os.mkfifo(f / "model.pth"), r"not a regular file"),
    "nan weights": (poison_weights, r"model.pth: tensor norm.weight holds NaN or infinite values"),
    "a flipped weight bit": (flip_a_weight_byte, r"model.pth: archive member .*/data/3 fails its CRC-32 check"),
    "a tensor viewing a hidden storage": (hide_a_storage, r"model.pth: its tensors view \d+ bytes of storage but hold"),
    "tokenizer larger than the embedding": (
        grow_tokenizer,
        r"tokenizer.json: the tokenizer has 513 tokens, more than the model's embedding table",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE_CHECKPOINTS))
def test_hostile_checkpoint_is_one_line_and_non_zero(name, checkpoint, capsys, tmp_path):
    edit, message = HOSTILE_CHECKPOINTS[name]
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoint.parent, folder)
    edit(folder)
    (tmp_path / "out").mkdir()
    code, _, err = run(generate_args(folder, "--metrics_json", str(tmp_path / "out" / "m.json")), capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert str(folder) in err and re.search(message, err), err
    assert list((tmp_path / "out").iterdir()) == []


def huge_token_gguf(path):
    """A GGUF whose one token is a million characters long."""
    token = b"a" * 10**6
    entry = struct.pack("<Q", 21) + b"tokenizer.ggml.tokens" + struct.pack("<IIQQ", 9, 8, 1, len(token)) + token
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + entry)
    return path


def hf_folder_with_template(template):
    """A tiny Hugging Face folder whose chat_template.jinja is ``template``."""

    def make(path):
        save_hf_llama(path)
        (path / "chat_template.jinja").write_text(template)
        return path

    return make


def gguf_with_template(template):
    """A tiny GGUF whose tokenizer.chat_template is ``template``."""

    def make(path):
        tokenizer = train_bpe_tokenizer(path.parent / "tokenizer", vocab_size=300)
        return write_gguf(path, tokenizer, edit=lambda writer: writer.add_chat_template(template))

    return make


RECURSING_TEMPLATE = "{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}"
NESTED_LOOPS_TEMPLATE = (
    "{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(9) %}{% endfor %}{% endfor %}{% endfor %}"
)


def gguf_with_a_string_add_bos(path):
    """A tiny GGUF whose tokenizer.ggml.add_bos_token is the string "no"."""
    tokenizer = train_bpe_tokenizer(path.parent / "tokenizer", vocab_size=300)
    return write_gguf(path, tokenizer, edit=set_key("tokenizer.ggml.add_bos_token", "add_string", "no"))


def bad_hf_folder(path):
    path.mkdir()
    config = hf_config_dict(get_shape("tiny")) | {"tie_word_embeddings": "false"}
    (path / "config.json").write_text(json.dumps(config))
    return path


def hf_folder_with_tokenizer_config(tokenizer_config):
    """A tiny Hugging Face folder whose tokenizer_config.json holds ``tokenizer_config``."""

    def make(path):
        save_hf_llama(path)
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        return path

    return make


HOSTILE_SOURCES = {
    "a pipe": (lambda p: os.mkfifo(p) or p, r"source .*src is not a regular file \(a pipe, socket or device\)"),
    "added tokens as a list": (
        hf_folder_with_tokenizer_config({"added_tokens_decoder": [{"content": "<s>"}]}),
        r"src/tokenizer_config.json: added_tokens_decoder must be an object of token id -> token",
    ),
    "an eos_token of numeric type": (
        hf_folder_with_tokenizer_config({"eos_token": 1}),
        r"src/tokenizer_config.json: eos_token must be a string or an object with a string content, got 1",
    ),
    "a GGUF token of a million characters": (huge_token_gguf, r"tokenizer.ggml.tokens\[0\] is 1000000 bytes long"),
    "an HF config of the wrong types": (bad_hf_folder, r"field tie_word_embeddings has the wrong type"),
    "an HF chat template that recurses": (
        hf_folder_with_template(RECURSING_TEMPLATE),
        r"src/chat_template.jinja: chat template( line \d+)?: (it recurses too deeply|the template takes more than)",
    ),
    "an HF chat template of nested loops": (
        hf_folder_with_template(NESTED_LOOPS_TEMPLATE),
        r"src/chat_template.jinja: chat template line 1: the template takes more than 1,000,000 steps of work",
    ),
    "an HF chat template multiplying a string": (
        hf_folder_with_template("{{ messages[0]['content'] * 10**9 }}"),
        r"src/chat_template.jinja: chat template line 1: .* would hold more than 4,194,304 characters",
    ),
    "a GGUF chat template multiplying a string": (
        gguf_with_template("{{ 'x' * 10**10 }}"),
        r"src: GGUF metadata tokenizer.chat_template: chat template line 1: .* would hold more than 4,194,304",
    ),
    "a GGUF add_bos_token of the string no": (
        gguf_with_a_string_add_bos,
        r"src: GGUF metadata "
        r"tokenizer.ggml.add_bos_token has the wrong type or value \(STRING; it must be true or false",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE_SOURCES))
@pytest.mark.parametrize("existing", [False, True], ids=["new output", "existing checkpoint"])
def test_hostile_source_writes_nothing(name, existing, checkpoint, capsys, tmp_path):
    make, message = HOSTILE_SOURCES[name]
    source = make(tmp_path / "src")
    capsys.readouterr()  # what making the source printed
    out = tmp_path / "out"
    if existing:
        shutil.copytree(checkpoint.parent, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()} if existing else None
    code, _, err = run(["convert", str(source), "--output_dir", str(out)], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert re.search(message, err), err
    assert ({p.name: p.read_bytes() for p in out.iterdir()} if existing else out.exists()) == (before or False)


@pytest.mark.slow
def test_generate_says_whether_the_compile_cache_was_cold_or_warm(checkpoint, tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "t")}
    args = [sys.executable, "-m", "gpt_fast", "generate", "--checkpoint_path", str(checkpoint), "--compile", "default"]
    labels = []
    for _ in range(2):
        result = subprocess.run(
            [*args, "--max_new_tokens", "3", "--num_samples", "1"], capture_output=True, text=True, env=env, timeout=600
        )
        assert result.returncode == 0, result.stderr
        labels.append(re.search(r"Compilation time: [\d.]+ seconds \(compile cache (\w+):", result.stdout).group(1))
    assert labels == ["cold", "warm"]


def modules_after(argv: list[str]) -> dict[str, bool]:
    """Which heavy modules a fresh process has imported once `gpt-fast ARGV` has ended."""
    code = (
        "import sys\nfrom gpt_fast.cli.main import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(' '.join(str(name in sys.modules) for name in ('torch', 'torch._inductor', 'torch._dynamo')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    torch_, inductor, dynamo = (word == "True" for word in done.stdout.split()[-3:])
    return {"torch": torch_, "inductor": inductor, "dynamo": dynamo}


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["generate", "--help"],
        ["chat", "--help"],
        ["generate", "--compile", "turbo"],
        ["generate", "--max_new_tokens", "many"],
        ["generate", "--no_such_option"],
        ["quantize"],
        ["generate", "--temperature", "-1"],
        ["generate", "--max_new_tokens", "0"],
        ["generate", "--seed", "-1"],
        ["generate", "--tp", "0"],
        ["generate", "--threads", "0"],
        ["generate", "--prompt_lookup", "99"],
        ["chat", "--max_new_tokens", "0"],
        ["serve", "--port", "70000"],
        ["serve", "--max_batch", "0"],
        ["eval", "--window", "1"],
        ["bench", "decode", "--repeats", "0"],
        ["bench", "serve", "--clients", "0"],
        ["bench", "tp", "--repeats", "0"],
    ],
)
def test_help_and_argument_errors_import_no_torch(argv):
    """Help and mistakes in the arguments, range errors included, are answered before torch is imported."""
    assert modules_after(argv)["torch"] is False


def test_an_eager_run_imports_no_inductor(checkpoint):
    modules = modules_after(generate_args(checkpoint, "--num_samples", "1", "--max_new_tokens", "3"))
    assert modules == {"torch": True, "inductor": False, "dynamo": False}


def test_help_says_how_cpu_threads_are_chosen(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "OMP_NUM_THREADS" in " ".join(out.split())


def test_threads_asked_for_are_used_and_said(checkpoint, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the flag wins over the environment
    before = torch.get_num_threads()
    try:
        code, out, err = run(generate_args(checkpoint, "--threads", "1", "--device", "cpu"), capsys)
        assert code == 0, err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "(CPU, 1 thread (as asked))" in out.splitlines()[0]


@pytest.mark.parametrize(
    "contents, message",
    [
        ({"notes.txt": "mine"}, "it holds notes.txt and no gpt-fast checkpoint"),
        ({"config.json": '{"architectures": ["LlamaForCausalLM"]}'}, "is not a gpt-fast checkpoint's"),
    ],
    ids=["a user's files", "a Hugging Face folder"],
)
def test_quantize_refuses_a_folder_that_is_not_a_checkpoint(contents, message, checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    for name, text in contents.items():
        (out / name).write_text(text)
    code, _, err = run(
        ["quantize", "--checkpoint_path", str(checkpoint), "--mode", "int8", "--output_dir", str(out)], capsys
    )
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_text() for p in out.iterdir()} == contents


def test_a_quantized_kernel_that_cannot_run_here_is_one_line(checkpoint, tmp_path, capsys):
    """``--quant_kernel gemlite`` (or ``triton``) on the CPU, with an int8 checkpoint: refused before loading."""
    out = tmp_path / "int8"
    code, _, err = run(
        ["quantize", "--checkpoint_path", str(checkpoint), "--mode", "int8", "--output_dir", str(out)], capsys
    )
    assert code == 0, err
    code, stdout, err = run(generate_args(out / "model.pth", "--quant_kernel", "gemlite"), capsys)
    assert code != 0 and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert "the gemlite quantized kernel needs a CUDA GPU with Triton and the gemlite package" in err
    assert "Loading model" not in stdout


def test_quantize_replaces_a_checkpoint_as_a_whole(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(checkpoint.parent, out)
    code, _, err = run(
        ["quantize", "--checkpoint_path", str(checkpoint), "--mode", "int8", "--output_dir", str(out)], capsys
    )
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["quantization"]["mode"] == "int8"


@pytest.mark.parametrize("rows", [["--batch_size", "3"], ["--prompt", "a", "--prompt", "b", "--prompt", "c"]])
def test_several_sequences_report_per_sequence_and_in_all(rows, checkpoint, capsys):
    code, out, err = run(generate_args(checkpoint, "--ignore_eos", *rows), capsys)
    assert code == 0, err
    sample = re.search(
        r"Sample 2/2: 12 tokens per sequence in .* ([\d.]+) tokens/sec per sequence \(([\d.]+) in all, 3 sequences\)",
        out,
    )
    assert sample, out
    average = re.search(
        r"Average tokens/sec \(samples 2-2\): ([\d.]+) per sequence, ([\d.]+) in all \(3 sequences\)", out
    )
    assert average, out
    for found in (sample, average):
        per_sequence, together = map(float, found.groups())
        assert together == pytest.approx(3 * per_sequence, rel=0.01)


def test_the_profilers_own_lines_stay_out_of_the_output(checkpoint, tmp_path):
    argv = generate_args(checkpoint, "--num_samples", "1", "--profile", str(tmp_path / "trace.json"))
    result = subprocess.run(
        [sys.executable, "-m", "gpt_fast", *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "profiler_st" not in result.stdout + result.stderr  # kineto's "profiler_start", "profiler_stop"
    assert "Trace written to" in result.stdout
