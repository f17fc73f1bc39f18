"""`gpt-fast bench` on the CPU with a tiny model: each mode in its own process, consistent figures, every output."""

import csv
import json
import sys

import pytest
import torch

from gpt_fast.bench import modes as bench
from gpt_fast.bench.modes import copy_bandwidth_gbps
from gpt_fast.cli.main import main
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.options import SpeculativeOptions
from gpt_fast.jobs.generate import run_generate
from gpt_fast.jobs.options import GenerateOptions
from gpt_fast.model.shapes import get_shape


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    checkpoint = make_random_checkpoint(get_shape("tiny"), folder / "tiny", dtype=torch.float32)
    out = folder / "results"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "bench",
                "--checkpoint_path",
                str(checkpoint),
                "--modes",
                "none,default",
                "--max_new_tokens",
                "16",
                "--num_samples",
                "3",
                "--device",
                "cpu",
                "--output_dir",
                str(out),
                "--profile",
                str(folder / "traces") + "/",
            ]
        )
    assert exit_info.value.code == 0
    return out, folder / "traces"


def test_every_output_is_written(bench_run):
    out, traces = bench_run
    names = {p.name for p in out.iterdir()}
    assert {
        "bench.json",
        "bench.csv",
        "bench.md",
        "metrics_none.json",
        "metrics_default.json",
        "log_none.txt",
        "log_default.txt",
    } <= names
    assert {p.name for p in traces.iterdir()} == {"trace_compile_none.json", "trace_compile_default.json"}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "bench.png" not in names
    else:
        assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figures_are_positive_and_consistent(bench_run):
    out, _ = bench_run
    report = json.loads((out / "bench.json").read_text())
    assert report["copy_bandwidth_gbps"] > 0 and report["device"] == "cpu"
    by_mode = {r["mode"]: r for r in report["results"]}
    assert list(by_mode) == ["none", "default"]
    for mode, r in by_mode.items():
        assert r["ok"] and r["samples"] == 2
        assert 0 < r["tokens_per_sec_min"] <= r["tokens_per_sec_median"] <= r["tokens_per_sec_max"]
        assert r["bandwidth_gbps"] == pytest.approx(report["weight_bytes_per_token"] * r["tokens_per_sec_median"] / 1e9)
        assert r["copy_fraction"] == pytest.approx(r["bandwidth_gbps"] / report["copy_bandwidth_gbps"])
        assert r["ttft_ms_median"] > 0 and r["memory_gb"] > 0
        assert r["trace"]["tokens"] == 15 and r["trace"]["graph_launches"] == 0
        metrics = json.loads((out / f"metrics_{mode}.json").read_text())
        assert metrics["compile"] == mode
    assert by_mode["none"]["compile_seconds"] is None and by_mode["default"]["compile_seconds"] > 0


def test_table_and_csv_agree(bench_run):
    out, _ = bench_run
    table = (out / "bench.md").read_text()
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [r["mode"] for r in rows] == ["none", "default"]
    for row in rows:
        assert f"| {row['mode']} |" in table
        assert f"{float(row['tokens_per_sec_median']):.1f}" in table


def test_copy_bandwidth_is_measured():
    assert copy_bandwidth_gbps(torch.device("cpu")) > 0.1


def test_unknown_mode_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "bench",
                "--checkpoint_path",
                str(tmp_path),
                "--modes",
                "none,fastest",
                "--output_dir",
                str(tmp_path / "o"),
            ]
        )
    assert exit_info.value.code == 1
    assert "fastest" in capsys.readouterr().err


def test_compile_caches_are_cold_by_default(bench_run):
    out, _ = bench_run
    by_mode = {r["mode"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
    assert by_mode["none"]["compile_cache"] is None and by_mode["default"]["compile_cache"] == "cold"
    assert "| default | cold |" in (out / "bench.md").read_text()


def test_profiled_sample_stays_out_of_the_figures(bench_run):
    out, _ = bench_run
    metrics = json.loads((out / "metrics_default.json").read_text())
    result = {r["mode"]: r for r in json.loads((out / "bench.json").read_text())["results"]}["default"]
    timed = [s["tokens_per_sec"] for s in metrics["samples"] if not s["warmup"] and not s["profiled"]]
    assert result["samples"] == len(timed) == 2 and metrics["samples"][-1]["profiled"]
    assert result["tokens_per_sec_median"] == pytest.approx(sorted(timed)[0] / 2 + sorted(timed)[1] / 2)
    assert result["profiled_tokens_per_sec"] == pytest.approx(metrics["samples"][-1]["tokens_per_sec"])


def test_warm_cache_primes_each_mode_with_its_own_cache(tmp_path, monkeypatch):
    runs = []

    def fake_child(run):
        runs.append(run)
        return "stopped here"  # a failure ends the mode: the runs so far are what is checked

    monkeypatch.setattr(bench, "run_child", fake_child)
    engine, generate = EngineOptions(device="cpu"), GenerateOptions(num_samples=4, profile=str(tmp_path) + "/")
    result = bench.run_mode(tmp_path / "ckpt", "default", engine, generate, tmp_path, copy_gbps=1.0, warm_cache=True)
    assert not result.ok and result.error == "priming run: stopped here"
    (priming,) = runs
    assert (
        priming.generate.num_samples == 1 and priming.generate.profile is None and priming.engine.compile == "default"
    )
    runs.clear()
    monkeypatch.setattr(
        bench, "run_child", lambda run: runs.append(run) or (object() if len(runs) == 1 else "measured")
    )
    result = bench.run_mode(tmp_path / "ckpt", "default", engine, generate, tmp_path, copy_gbps=1.0, warm_cache=True)
    assert [r.generate.num_samples for r in runs] == [1, 4] and runs[0].compile_cache == runs[1].compile_cache
    assert result.error == "measured" and result.compile_cache == "warm"
    runs.clear()
    monkeypatch.setattr(bench, "run_child", fake_child)
    bench.run_mode(tmp_path / "ckpt", "default", engine, generate, tmp_path, copy_gbps=1.0, warm_cache=False)
    bench.run_mode(tmp_path / "ckpt", "none", engine, generate, tmp_path, copy_gbps=1.0, warm_cache=False)
    assert len(runs) == 2 and runs[0].compile_cache != runs[1].compile_cache  # each mode an empty cache of its own


def test_bench_fails_when_every_mode_failed(tmp_path, capsys):
    checkpoint = make_random_checkpoint(get_shape("tiny"), tmp_path / "tiny", dtype=torch.float32)
    checkpoint.write_bytes(b"not a weights file")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--checkpoint_path", str(checkpoint), "--modes", "none", "--device", "cpu",
              "--output_dir", str(tmp_path / "out"), "--num_samples", "1", "--max_new_tokens", "2"])  # fmt: skip
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: every mode failed")
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert not report["results"][0]["ok"] and "model.pth" in report["results"][0]["error"]


def test_speculative_decoding_gets_its_columns(tmp_path):
    checkpoint = make_random_checkpoint(get_shape("tiny"), tmp_path / "tiny", dtype=torch.float32)
    options = EngineOptions(device="cpu", speculative=SpeculativeOptions(prompt_lookup=2, k=3))
    generate = GenerateOptions(prompt="abcabc", max_new_tokens=10, num_samples=2, stream=False, ignore_eos=True)
    metrics = run_generate(Engine.open(checkpoint, options), generate, write=lambda _text: None)
    result = bench.mode_result("none", metrics, 1.0, None, tmp_path / "log.txt")
    spec = metrics.speculative
    assert (result.acceptance_rate, result.tokens_per_step) == (spec.acceptance_rate, spec.tokens_per_step)
    assert (result.draft_ms_per_step, result.verify_ms_per_step) == (spec.draft_ms_per_step, spec.verify_ms_per_step)
    report = bench.BenchReport("c", "cpu", "CPU", "2", "today", "gpt-fast bench", 1.0, 1, [result])
    header, _, row = bench.markdown_table(report).splitlines()[-3:]
    assert header.endswith("| acceptance | tokens/verify step | draft ms/step | verify ms/step |")
    assert row.endswith(
        f"| {spec.acceptance_rate:.1%} | {spec.tokens_per_step:.2f} | {spec.draft_ms_per_step:.2f} | "
        f"{spec.verify_ms_per_step:.2f} |"
    )


def test_without_matplotlib_no_chart_is_said(tmp_path, monkeypatch):
    from gpt_fast.bench.modes import report_chart

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    said = []
    report_chart(tmp_path / "bench.png", None, "title", said.append)
    assert said == ["No chart written: bench.png needs matplotlib (pip install matplotlib)"]
    assert not (tmp_path / "bench.png").exists()
