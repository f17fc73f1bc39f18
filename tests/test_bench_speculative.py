"""`gpt-fast bench speculative` on the CPU with tiny models: every row, the tables, the JSON."""

import json
from types import SimpleNamespace

import pytest
import torch

from gpt_fast.bench.options import SpeculativeBenchOptions
from gpt_fast.bench.speculative import expected_tokens_per_round, record_for_replay, run
from gpt_fast.cli.main import main
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.generation.decode import cache_length
from gpt_fast.generation.speculative import MAX_ROUNDS_AHEAD, speculative_cache_length
from gpt_fast.model.shapes import get_shape
from tests.tiny import one_torch_thread

COMMON = {"device": "cpu", "mode": "none", "dtype": "float32", "new_tokens": 24, "repeats": 1}
COMMON_ARGS = ["--device", "cpu", "--mode", "none", "--dtype", "float32", "--new_tokens", "24", "--repeats", "1"]


@pytest.fixture(autouse=True)
def one_thread():
    with one_torch_thread():
        yield


def test_random_shapes_with_a_draft(tmp_path, capsys):
    args = {"shape": "tiny", "draft_shape": "tiny", "prompt_lookup": (2,), "k": (2, 3), "agreements": (0.5,)}
    run(SpeculativeBenchOptions(**args, **COMMON, json=str(tmp_path / "rows.json")))
    out = capsys.readouterr().out
    rows = {(r["name"], r["k"]): r for r in json.loads((tmp_path / "rows.json").read_text())}
    names = ["plain decoding", "replay", "prompt lookup 2", "draft model", "replay 50% + draft steps"]
    assert list(rows) == [(names[0], None)] + [(name, k) for k in (2, 3) for name in names[1:]]
    plain = rows["plain decoding", None]
    for (name, k), row in rows.items():
        assert row["tokens"] == plain["tokens"] and row["tokens_per_sec"] > 0, name  # greedy: the same text
        if k is not None:
            assert row["speculative"]["k"] == k and row["speculative"]["rounds"] > 0
    assert rows["replay", 3]["speculative"]["acceptance_rate"] == 1.0
    assert rows["replay", 3]["speculative"]["tokens_per_step"] == 4.0
    assert "tiny (random weights), draft tiny; CPU, torch" in out and "greedy, prompt 32 tokens, 24 new tokens" in out
    table = [line for line in out.splitlines() if line.startswith("| replay | 3 |")]
    assert len(table) == 1 and "| yes | 100.0% | 4.00 |" in table[0]
    assert "| 3 | 50% |" in out  # the agreement table: predicted against measured


def test_a_checkpoint_with_prompt_lookup(tmp_path, capsys):
    checkpoint = make_random_checkpoint(get_shape("tiny"), tmp_path / "tiny", dtype=torch.float32)
    (tmp_path / "prompt.txt").write_text("abcabcabcabc")
    args = {"checkpoint_path": str(checkpoint), "prompt_file": str(tmp_path / "prompt.txt"), "ignore_eos": True}
    run(SpeculativeBenchOptions(**args, prompt_lookup=(3,), **COMMON, json=str(tmp_path / "rows.json")))
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["name"] for r in rows] == ["plain decoding", "replay", "prompt lookup 3"]
    assert all(r["tokens"] == rows[0]["tokens"] and len(r["tokens"]) == 24 for r in rows)
    assert "| agreement |" not in capsys.readouterr().out  # no draft model, no agreement table


@pytest.mark.parametrize("source", ["shape", "checkpoint"])
def test_batch_invariant_rows_compare_with_plain_decoding_on_their_own_kernels(source, tmp_path, capsys):
    """Plain decoding with the usual kernels first (the speed-ups' baseline, on a second engine), then on the
    batch-invariant target, whose text the speculative rows are compared with."""
    args = {"shape": "tiny"}
    if source == "checkpoint":
        checkpoint = make_random_checkpoint(get_shape("tiny"), tmp_path / "tiny", dtype=torch.float32)
        args = {"checkpoint_path": str(checkpoint), "prompt": "abcabcabcabc", "ignore_eos": True}
    rows_file = str(tmp_path / "rows.json")
    run(SpeculativeBenchOptions(**args, batch_invariant=True, prompt_lookup=(2,), **COMMON, json=rows_file))
    rows = json.loads((tmp_path / "rows.json").read_text())
    names = ["plain decoding, usual kernels", "plain decoding, batch-invariant", "replay", "prompt lookup 2"]
    assert [r["name"] for r in rows] == names
    assert [r["kernels"] for r in rows] == ["usual"] + ["batch-invariant"] * 3
    assert all(r["tokens"] == rows[1]["tokens"] for r in rows[2:])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| replay | 4 |")]
    assert len(lines) == 1 and "| yes | 100.0% | 5.00 |" in lines[0]


@pytest.mark.parametrize(
    "args, message, code",
    [
        (["--k", "two"], "--k: 'two' is not a comma-separated list of int values", 1),
        (["--k", "0"], r"--k must be an integer in 1\.\.16, got 0", 2),  # a usage error, naming the bench's flag
        (["--prompt_lookup", "2", "--new_tokens", "600"], "exceeds the model's context of 512 tokens", 1),
    ],
)
def test_mistakes_are_one_line(args, message, code, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "speculative", "--shape", "tiny", *COMMON_ARGS, *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == code and len(err.strip().splitlines()) == 1
    assert __import__("re").search(message, err), err


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


CONTEXT = 4096  # the stand-in model's context


class CacheLengthText:
    """A stand-in for the benchmark's setup whose target's greedy text depends on its KV cache's length, as the
    batch-invariant Llama-2-7B shape's can on an H200 (docs/bench/HISTORY.md, 2026-11-23g): new token i is i, plus 1000
    from token 10 on when the cache holds 320 positions or more. Speculative requests give the target's text whatever
    the proposals, and their caches hold the host's run-ahead rounds too."""

    prompt = list(range(32))
    new_tokens = 200

    def generate(self, drafter, tokens=None):
        n = tokens or self.new_tokens
        if drafter is None:
            cache = cache_length(len(self.prompt), n, CONTEXT)
        else:
            cache = speculative_cache_length(len(self.prompt), n, drafter.k, CONTEXT)
        text = [i + (1000 if cache >= 320 and i >= 10 else 0) for i in range(n)]
        return lambda: SimpleNamespace(tokens=[text])


def test_the_replay_is_recorded_from_the_request_it_replays():
    """The recording is what the timed replay (a request of ``new_tokens``) produces, not what a longer request with
    a longer cache would; the timed replay then keeps every proposal."""
    setup = CacheLengthText()
    recorded = record_for_replay(setup, 4)
    timed = setup.generate(SimpleNamespace(k=4))().tokens[0]
    assert recorded[: setup.new_tokens] == timed
    assert len(recorded) == setup.new_tokens + (MAX_ROUNDS_AHEAD + 1) * 5
