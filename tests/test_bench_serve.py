"""`gpt-fast bench serve` end to end on the CPU with the tiny shape: one invocation writes the checkpoint,
runs `gpt-fast generate`, then the server with one client and with several, and prints every figure the targets
need; the JSON agrees with the table."""

from __future__ import annotations

import json
import re

import pytest

from gpt_fast.bench.options import ServeBenchOptions
from gpt_fast.bench.serve import run


@pytest.mark.slow
def test_one_run_prints_every_figure(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    output = tmp_path / "figures.json"
    options = {"shape": "tiny", "device": "cpu", "dtype": "float32", "compile": "none", "clients": 3}
    run(ServeBenchOptions(**options, rounds=1, max_tokens=6, workdir=str(tmp_path), output=str(output)))
    out = capsys.readouterr().out
    figures = json.loads(output.read_text())
    one, many = figures["one"], figures["many"]
    assert one["clients"] == 1 and many["clients"] == 3
    for load in (one, many):
        assert 0 < load["ttft_p50_ms"] <= load["ttft_p99_ms"]
        assert 0 < load["slowest_client_tokens_per_sec"] <= load["per_client_tokens_per_sec"]
    assert f"| `gpt-fast generate` | {figures['generate_tokens_per_sec']:.1f} |" in out
    assert f"| server, 3 clients | {many['per_client_tokens_per_sec']:.1f} |" in out
    for line in ("aggregate with 3 clients / one client: ", "slowest of 3 clients / one client: "):
        assert re.search(re.escape(line) + r"\d", out)
    through = 100 * one["per_client_tokens_per_sec"] / figures["generate_tokens_per_sec"]
    assert f"one client through the server / gpt-fast generate: {through:.0f} %" in out
