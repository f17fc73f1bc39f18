"""bench_tp: the table's arithmetic, the world sizes it takes, and (slow) one whole CPU run of two world sizes."""

from __future__ import annotations

import dataclasses

import pytest

from gpt_fast.bench.options import TpBenchOptions
from gpt_fast.bench.tp import Result, run, table
from gpt_fast.cli.bench import parse_world_sizes


def test_the_table_divides_by_the_single_gpu_and_the_summed_copy_bandwidth():
    one = Result("s", 1, tokens_per_sec=60.0, bytes_per_token=[2_000_000_000], copy_gbps=[4000.0])
    two = Result(
        "s", 2, tokens_per_sec=100.0, bytes_per_token=[10**9, 10**9], copy_gbps=[4000.0, 4000.0],
        collective_us_per_token=12.5, collective_kernels_per_token=2.0,
    )  # fmt: skip
    lines = table([one, two, Result("s", 4, skipped="2 GPU(s) on this host")]).splitlines()
    assert lines[2].startswith("| s | 1 | 60.0 | 1.00 | 2.00 | 120 | 3.0 | — | — |")
    assert lines[3].startswith("| s | 2 | 100.0 | 1.67 | 1.00 | 100 | 2.5 | 12.5 | 2.0 |")
    assert lines[4].startswith("| s | 4 | skipped: 2 GPU(s) on this host |")


@pytest.mark.parametrize("text", ["", "1,,2", "0,2", "two"])
def test_world_sizes_must_be_a_list_of_positive_numbers(text):
    with pytest.raises(ValueError, match="is not a comma-separated list of world sizes"):
        parse_world_sizes(text)


def test_a_shape_that_does_not_split_is_refused_before_any_run():
    with pytest.raises(ValueError, match="tp 3: model.n_head"):
        run(TpBenchOptions(shape="llama-2-7b", tp=(1, 3), device="cpu"))


def test_a_kernel_option_is_checked_before_any_run():
    with pytest.raises(ValueError, match="kernels.linear 'cuda' is not one of auto, triton, torch"):
        run(TpBenchOptions(shape="tiny", tp=(1, 2), device="cpu", linear_kernel="cuda"))


@pytest.mark.slow
def test_one_invocation_measures_every_world_size(capsys, tmp_path):
    traces = tmp_path / "not" / "made"
    options = TpBenchOptions(shape="tiny", tp=(1, 2), device="cpu", mode="none", dtype="float32", new_tokens=8)
    results = run(dataclasses.replace(options, repeats=1, trace_dir=str(traces)))
    assert [(r.world_size, r.skipped) for r in results] == [(1, None), (2, None)]
    assert sorted(p.name for p in traces.iterdir()) == ["trace_tp1.json", "trace_tp2.json"]
    assert results[1].bytes_per_token[0] < results[0].bytes_per_token[0] and len(results[1].copy_gbps) == 2
