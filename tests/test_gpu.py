"""GPU-only checks (CUDA or ROCm): every compile mode runs, and the traces show what each mode launches.

Run on a GPU machine with `python -m pytest -q -m gpu tests/test_gpu.py`; skipped without one."""

import json
import subprocess
import sys

import pytest
import torch

from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.generate import COMPILE_MODES
from gpt_fast.shapes import get_shape
from gpt_fast.trace_summary import summarize_trace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny"), dtype=torch.bfloat16, seed=3)


def generate(checkpoint, folder, mode, *extra):
    metrics = folder / f"metrics_{mode}.json"
    command = [
        sys.executable,
        "-m",
        "gpt_fast",
        "generate",
        "--checkpoint_path",
        str(checkpoint),
        "--device",
        "cuda",
        "--compile",
        mode,
        "--max_new_tokens",
        str(NEW_TOKENS),
        "--num_samples",
        "3",
        "--temperature",
        "0",
        "--ignore_eos",
        "--no_stream",
        "--metrics_json",
        str(metrics),
        *extra,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(metrics.read_text())


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    return {
        mode: generate(checkpoint, folder, mode, "--profile", str(folder / f"trace_{mode}"))
        | {"trace": folder / f"trace_{mode}.json"}
        for mode in COMPILE_MODES
    }


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_every_mode_runs_and_agrees_with_eager(runs, mode):
    eager = runs["none"]["samples"][-1]["generated_ids"]
    samples = runs[mode]["samples"]
    assert all(s["new_tokens"] == NEW_TOKENS and s["tokens_per_sec"] > 0 for s in samples)
    assert samples[-1]["generated_ids"] == eager  # greedy: same tokens, compiled or not
    assert (runs[mode]["compile_seconds"] is None) == (mode == "none")


def test_reduce_overhead_launches_one_graph_per_token(runs):
    summary = summarize_trace(runs["reduce-overhead"]["trace"])
    assert summary.tokens == NEW_TOKENS - 1
    assert summary.graph_launches_per_token == pytest.approx(1.0, abs=0.05)
    assert summary.kernel_launches_per_token < 0.1  # no per-kernel launches left in decode
    assert summary.gpu_kernels_per_token > 5  # the graph's kernels still run and are recorded


def test_eager_launches_kernels_and_no_graphs(runs):
    summary = summarize_trace(runs["none"]["trace"])
    assert summary.tokens == NEW_TOKENS - 1
    assert summary.graph_launches == 0
    assert summary.kernel_launches_per_token > 20
    assert summary.gpu_kernels_per_token == pytest.approx(summary.kernel_launches_per_token, rel=0.2)


def test_default_mode_fuses_kernels(runs):
    eager, compiled = summarize_trace(runs["none"]["trace"]), summarize_trace(runs["default"]["trace"])
    assert compiled.graph_launches == 0
    assert compiled.kernel_launches_per_token < eager.kernel_launches_per_token / 2
