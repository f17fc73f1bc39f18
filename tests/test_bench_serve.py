"""`gpt-fast bench serve` end to end on the CPU with the tiny shape: one invocation writes the checkpoint, runs
`gpt-fast generate` (the fixed workload), then the server with one client and with each count of clients, and
prints every figure, a row per run; the JSON agrees with the table. The mixed workload's requests are drawn from
the seed within their ranges, and are what the clients send; a mistake in the options is one error line before
anything is loaded."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from gpt_fast.bench import serve
from gpt_fast.bench.options import ServeBenchOptions
from gpt_fast.bench.serve import Load, run
from gpt_fast.bench.workload import plan, system_prompt
from gpt_fast.cli.main import main
from gpt_fast.model.shapes import get_shape

TINY = {"shape": "tiny", "device": "cpu", "dtype": "float32", "compile": "none"}
MIXED = {"workload": "mixed", "prompt_tokens": (8, 24), "answer_tokens": (16, 32), "system_prompt_tokens": 16}


def rows(out: str) -> list[list[str]]:
    """The table's server rows, as their cells."""
    lines = [line for line in out.splitlines() if line.startswith("| server, ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def expected_row(load: dict) -> list[str]:
    """A run's row as the JSON's figures give it."""

    def ms(value: float | None) -> str:
        return "–" if value is None else f"{value:.1f} ms"

    rate = load["prefix_hit_rate"]
    rates = ("per_client_tokens_per_sec", "slowest_client_tokens_per_sec", "aggregate_tokens_per_sec")
    latencies = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    return [
        f"server, {load['clients']} client{'s' if load['clients'] > 1 else ''}",
        str(load["requests"]),
        *(f"{load[name]:.1f}" for name in rates),
        *(ms(load[name]) for name in latencies),
        str(load["peak_blocks_used"]),
        "–" if rate is None else f"{100 * rate:.0f} %",
        str(load["preemptions"]),
    ]


def check_runs(figures: dict, out: str, counts: tuple[int, ...], rounds: int) -> None:
    """One row per count with every figure, each as the JSON has it, and plausible."""
    runs = figures["runs"]
    assert [load["clients"] for load in runs] == list(counts)
    assert rows(out) == [expected_row(load) for load in runs]
    assert f"| peak KV blocks (of {figures['cache']['blocks']}) |" in out
    for load in runs:
        assert set(load) == {field.name for field in dataclasses.fields(Load)}
        assert load["requests"] == load["clients"] * rounds
        assert 0 < load["ttft_p50_ms"] <= load["ttft_p99_ms"]
        assert 0 < load["itl_p50_ms"] <= load["itl_p99_ms"]
        assert 0 < load["slowest_client_tokens_per_sec"] <= load["per_client_tokens_per_sec"]
        assert 1 <= load["peak_blocks_used"] <= figures["cache"]["blocks"]
        assert load["prefix_hit_rate"] is None or 0 <= load["prefix_hit_rate"] <= 1
        assert load["preemptions"] >= 0
    for count in counts[1:]:
        for line in (f"aggregate with {count} clients / one client: ", f"slowest of {count} clients / one client: "):
            assert re.search(re.escape(line) + r"\d", out)


@pytest.fixture
def one_thread(monkeypatch):
    """One thread for each process of the run (the server and the benchmark share the machine)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.slow
def test_one_run_prints_every_figure(tmp_path, capsys, one_thread):
    """Answers of 96 tokens; the peak of KV blocks is the server's count over the run's steps, however short."""
    output = tmp_path / "figures.json"
    options = ServeBenchOptions(**TINY, clients=(3,), rounds=1, max_tokens=96, workdir=str(tmp_path))
    run(dataclasses.replace(options, output=str(output)))
    out = capsys.readouterr().out
    figures = json.loads(output.read_text())
    check_runs(figures, out, (1, 3), rounds=1)
    assert "  server: KV cache: paged, " in out  # the cache's size, echoed after the address
    assert figures["one"] == figures["runs"][0] and figures["many"] == figures["runs"][-1]
    assert f"| `gpt-fast generate` | | {figures['generate_tokens_per_sec']:.1f} |" in out
    through = 100 * figures["one"]["per_client_tokens_per_sec"] / figures["generate_tokens_per_sec"]
    assert f"one client through the server / gpt-fast generate: {through:.0f} %" in out


@pytest.mark.slow
def test_a_mixed_run_sends_its_planned_requests(tmp_path, capsys, one_thread, monkeypatch):
    """`--clients 1,3` on the mixed workload: a row per count, and the requests sent are the planned ones (warm-up
    first), each prompt the shared system prompt and then its own ids, each answer as long as it asked."""
    sent = []

    def recorded(host: str, port: int, body: dict) -> serve.Answer:
        answer = real(host, port, body)
        sent.append((tuple(body["prompt"]), body["max_tokens"], answer.tokens))
        return answer

    real = serve.stream_one
    monkeypatch.setattr(serve, "stream_one", recorded)
    output = tmp_path / "figures.json"
    options = ServeBenchOptions(**TINY, **MIXED, clients=(1, 3), rounds=2, workdir=str(tmp_path), output=str(output))
    run(options)
    out = capsys.readouterr().out
    figures = json.loads(output.read_text())
    check_runs(figures, out, (1, 3), rounds=2)
    assert figures["generate_tokens_per_sec"] is None and "gpt-fast generate" not in out
    planned = [
        (one.prompt, one.answer_tokens)
        for count in (1, 3)
        for warm_up in (True, False)
        for client in plan(options, count, warm_up)
        for one in client
    ]
    assert sorted((prompt, asked) for prompt, asked, _ in sent) == sorted(planned)
    assert all(asked == tokens for _, asked, tokens in sent)
    prefix = system_prompt(options)
    assert len(prefix) == 16 and all(prompt[:16] == prefix for prompt, _, _ in sent)


def test_the_mixed_draws_come_from_the_seed_within_their_ranges():
    options = ServeBenchOptions(workload="mixed", prompt_tokens=(3, 5), answer_tokens=(7, 9), system_prompt_tokens=4)
    drawn = plan(options, 8)
    assert plan(options, 8) == drawn and plan(dataclasses.replace(options, seed=1), 8) != drawn
    requests = [one for client in drawn for one in client]
    assert [len(client) for client in drawn] == [options.rounds] * 8
    prefix = system_prompt(options)
    assert {len(one.prompt) - len(prefix) for one in requests} == {3, 4, 5}
    assert {one.answer_tokens for one in requests} == {7, 8, 9}
    assert all(one.prompt[:4] == prefix for one in requests)
    assert all(0 <= token < get_shape(options.shape).vocab_size for one in requests for token in one.prompt)
    assert len({one.prompt[4:] for one in requests}) == len(requests)  # every prompt its own
    assert plan(options, 8, warm_up=True)[0][0] != drawn[0][0]  # the warm-up's requests are not the timed ones


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt_tokens", "100-10"], "--prompt_tokens 100-10 is not a range of token counts LOW-HIGH"),
        (["--answer_tokens", "0-8"], "--answer_tokens 0-8 is not a range of token counts LOW-HIGH"),
        (["--prompt_tokens", "8-"], "'--prompt_tokens': '8-' is not a range of token counts LOW-HIGH"),
        ([], "the longest request, --prompt_tokens 1024 \\+ --answer_tokens 512 = 1536 tokens, exceeds tiny's"),
        (["--prompt_tokens", "200", "--system_prompt_tokens", "300"], "--system_prompt_tokens 300 \\+ --prompt_to"),
        (["--max_tokens", "8"], "--max_tokens is the fixed workload's; the mixed one draws --answer_tokens"),
    ],
)
def test_a_bad_range_is_one_error_line_before_loading(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--shape", "tiny", "--workload", "mixed", "--workdir", str(tmp_path), *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code != 0 and len(lines) == 1 and lines[0].startswith("error: ")
    assert re.search(message, lines[0]), lines[0]
    assert list(tmp_path.iterdir()) == []  # no checkpoint written


def test_the_command_line_reads_counts_and_ranges(monkeypatch, capsys):
    """``--clients 8`` (one count, as before the lists) and ``--clients 1,8,32``; a range, and one length."""
    made = []
    monkeypatch.setattr(serve, "run", made.append)
    for args in (["--clients", "8"], ["--clients", "32,1,8", "--workload", "mixed", "--answer_tokens", "128"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "serve", *args])
        assert exit_info.value.code == 0
    assert [options.clients for options in made] == [(8,), (32, 1, 8)]
    assert [options.counts for options in made] == [(1, 8), (1, 8, 32)]
    assert made[1].prompt_tokens == (64, 1024) and made[1].answer_tokens == (128, 128)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--answer_tokens", "8-16"])
    assert exit_info.value.code == 2 and "--answer_tokens needs --workload mixed" in capsys.readouterr().err


def test_the_kv_cache_dtype_reaches_the_server(monkeypatch, tmp_path):
    """``--kv_cache_dtype``: the server's option (and generate's beside it), checked before anything is loaded."""
    made = []
    monkeypatch.setattr(serve, "run", made.append)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--kv_cache_dtype", "float8_e4m3fn"])
    assert exit_info.value.code == 0
    command = serve.Server(made[0], tmp_path, 1024).command
    assert command[command.index("--kv_cache_dtype") + 1] == "float8_e4m3fn"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--kv_cache_dtype", "int8"])
    assert exit_info.value.code == 2
