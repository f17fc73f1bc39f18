"""`gpt-fast bench`: its subcommands' help and option errors, `modes` without a subcommand, the `python -m` aliases,
and the options objects naming their options."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpt_fast.bench import tp
from gpt_fast.bench.options import DecodeBenchOptions, OptionError, SpeculativeBenchOptions, TpBenchOptions
from gpt_fast.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
SUBCOMMANDS = ("modes", "decode", "serve", "speculative", "tp")


def run_cli(args, capsys):
    """``gpt-fast ARGS``: its exit status, standard output and standard error."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_has_help(name, capsys):
    code, out, _ = run_cli(["bench", name, "--help"], capsys)
    assert code == 0 and out.startswith(f"Usage: gpt-fast bench {name} [OPTIONS]")


def test_the_group_help_lists_the_subcommands_and_the_default(capsys):
    code, out, _ = run_cli(["bench", "--help"], capsys)
    listed = [line.split()[0] for line in out.split("Commands:")[1].splitlines() if line.startswith("  ")]
    assert code == 0 and listed[: len(SUBCOMMANDS)] == sorted(SUBCOMMANDS)
    assert "Without a COMMAND, `gpt-fast bench [OPTIONS]` runs `gpt-fast bench modes [OPTIONS]`." in " ".join(
        out.split()
    )


@pytest.mark.parametrize(
    "args, message, status",
    [
        (["decode", "--builds", "0"], "--builds must be at least 1, not 0", 2),
        (["decode", "--shape", "huge"], "--shape 'huge' is not one of llama-2-7b,", 2),
        (["decode", "--group_size", "48"], "--group_size 48 is not one of 32, 64, 128, 256", 2),
        (["decode", "--mode", "fast"], "--mode 'fast' is not one of none, default, reduce-overhead, max-autotune", 2),
        (["decode", "--attention_kernels", ","], "--attention_kernels is empty", 2),
        (["decode", "--repeats", "many"], "'many' is not a valid integer", 2),
        (["serve", "--compile", "fast"], "--compile 'fast' is not one of none, default,", 2),
        (["serve", "--clients", "0"], "--clients must be at least 1, not 0", 2),
        (["serve", "--dtype", "int8"], "--dtype 'int8' is not one of bfloat16, float16, float32", 2),
        (["speculative", "--shape", "tiny", "--checkpoint_path", "x"], "--shape and --checkpoint_path exclude", 2),
        (["speculative", "--agreements", "0.5,2"], r"--agreements must lie in \[0, 1\], got 0.5,2.0", 2),
        (["speculative", "--k", "two"], "--k: 'two' is not a comma-separated list of int values", 1),
        (["tp", "--tp", "1,,2"], "--tp '1,,2' is not a comma-separated list of world sizes", 1),
        (["tp", "--repeats", "0"], "--repeats must be at least 1, not 0", 2),
        (["tp", "--no_such_option"], "No such option '--no_such_option'", 2),
    ],
)
def test_a_mistake_is_one_error_line(args, message, status, capsys):
    code, _, err = run_cli(["bench", *args], capsys)
    lines = err.strip().splitlines()
    assert code == status and len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(message, lines[0]), lines[0]


@pytest.mark.parametrize("args", [["--modes", "none", "--help"], ["--warm_cache", "-h"]])
def test_bench_without_a_subcommand_is_modes(args, capsys):
    code, out, _ = run_cli(["bench", *args], capsys)
    assert code == 0 and out.startswith("Usage: gpt-fast bench modes [OPTIONS]") and "--warm_cache" in out


def test_bench_without_a_subcommand_checks_modes_options(tmp_path, capsys):
    code, _, err = run_cli(["bench", "--modes", "none,fastest", "--output_dir", str(tmp_path)], capsys)
    assert code == 1 and err.strip().splitlines() == [
        "error: --modes: fastest; choose from none, default, reduce-overhead, max-autotune"
    ]


def test_the_options_name_their_options_not_flags():
    with pytest.raises(OptionError, match="^builds must be at least 1, not 0$") as error:
        DecodeBenchOptions(builds=0)
    assert error.value.naming(lambda option: f"--{option}") == "--builds must be at least 1, not 0"
    with pytest.raises(OptionError, match="^shape and checkpoint_path exclude each other$"):
        SpeculativeBenchOptions(shape="tiny", checkpoint_path="x")
    with pytest.raises(OptionError, match="^tp must be at least 1, not 0$"):
        TpBenchOptions(tp=(0,))


def test_the_command_line_imports_no_torch():
    """`gpt-fast --help` lists `bench`, whose options read their defaults without importing any benchmark."""
    code = "import sys, gpt_fast.cli.bench; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("module", ["gpt_fast.bench_decode", "gpt_fast.bench.decode"])
def test_python_m_is_an_alias(module):
    result = subprocess.run(
        [sys.executable, "-m", module, "--shape", "tiny", "--builds", "0"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2 and result.stderr.splitlines() == ["error: --builds must be at least 1, not 0"]


def test_a_rank_runs_the_command_the_benchmark_starts(tmp_path, monkeypatch, capsys):
    """The command each rank of `gpt-fast bench tp` runs, run here as the lone rank of one world size."""
    started = []

    def one_rank(nproc, module_args, timeout=None):
        started.append(module_args)
        assert module_args[:4] == ["gpt_fast", "bench", "tp", "--worker"]
        with pytest.raises(SystemExit) as exit_info:
            main(module_args[1:])
        return exit_info.value.code

    monkeypatch.setattr(tp, "run_ranks", one_rank)
    options = TpBenchOptions(shape="tiny", tp=(1,), device="cpu", mode="none", dtype="float32", new_tokens=4)
    result = tp.run_world_size(dataclasses.replace(options, repeats=1), 1, tmp_path)
    assert len(started) == 1 and result.skipped is None and result.world_size == 1 and result.tokens_per_sec > 0
    assert json.loads((tmp_path / "result_tp1.json").read_text())["shape"] == "tiny"
    assert (tmp_path / "trace_tp1.json").is_file()
