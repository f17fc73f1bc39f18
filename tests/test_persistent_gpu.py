"""GPU-only checks of the persistent layers kernel (``--layers_kernel triton``): one launch (every phase, the grid-wide
barriers between them) computes the model's layers; `gpt-fast generate` with it gives eager's greedy tokens in the
compiled modes, one kernel launch for all the layers of a token.

Run on a GPU machine with `python -m pytest -q -m gpu tests/test_persistent_gpu.py`; skipped without one."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from persistent_reference import report

from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.jobs.trace_summary import summarize_trace
from gpt_fast.model.shapes import get_shape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.version.hip is not None, reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed"),
]
NEW_TOKENS = 40


def test_one_launch_computes_the_layers():
    worst = report("cuda", phase_by_phase=False)
    assert worst["float32"] < 1e-5 and worst["bfloat16"] < 1e-2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny"), dtype=torch.bfloat16, seed=3)


def generate(checkpoint, folder, mode, *extra):
    metrics = folder / f"metrics_{mode}.json"
    command = [sys.executable, "-m", "gpt_fast", "generate", "--checkpoint_path", str(checkpoint), "--device", "cuda"]
    command += ["--compile", mode, "--max_new_tokens", str(NEW_TOKENS), "--num_samples", "2", "--temperature", "0"]
    command += ["--ignore_eos", "--no_stream", "--metrics_json", str(metrics), *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(metrics.read_text())


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_generate_with_the_kernel_gives_eagers_tokens(checkpoint, tmp_path, mode):
    eager = generate(checkpoint, tmp_path, "none")["samples"][-1]["generated_ids"]
    trace = tmp_path / "trace"
    run = generate(checkpoint, tmp_path, mode, "--layers_kernel", "triton", "--profile", str(trace))
    assert run["samples"][-1]["generated_ids"] == eager
    summary = summarize_trace(tmp_path / "trace.json")
    launches = trace.with_suffix(".json").read_text().count('"_decode_layers"')
    assert launches >= summary.tokens  # one launch per decoded token, every layer in it
