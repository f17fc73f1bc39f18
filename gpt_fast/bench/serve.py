"""The server under load, in one run: `gpt-fast generate` alone, then `gpt-fast serve` with one streaming client and
with N concurrent streaming clients, on the same checkpoint, compile mode and sampling. Prints one table: tokens/sec
per client and in all, time to first token (p50/p99), and the issue's three ratios.

    gpt-fast bench serve --shape llama-2-7b --compile reduce-overhead

A random-weight checkpoint of ``--shape`` (byte-level tokenizer) is written to ``--workdir`` first, and kept for the
next run. The clients are plain HTTP (``http.client``) threads in this process; the server and
`generate` each run in a subprocess of their own. Every request asks for exactly ``--max_tokens`` tokens
(``ignore_eos``), all from prompts of the same length.
"""

from __future__ import annotations

import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gpt_fast.bench.options import ServeBenchOptions
from gpt_fast.generation.decode import cache_length
from gpt_fast.model.shapes import get_shape
from gpt_fast.util.fileio import write_text_atomic

PROMPT = "def quicksort(arr):\n    # sort the list in place, client {client:02d}, round {round:02d}\n"


@dataclass(frozen=True)
class Answer:
    """One streamed answer, timed by its client from the moment the request was sent."""

    tokens: int
    ttft: float  # seconds to the first text
    seconds: float  # to the end

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Load:
    """``clients`` streaming at once, ``rounds`` times."""

    clients: int
    per_client_tokens_per_sec: float  # median over clients and rounds
    slowest_client_tokens_per_sec: float  # the slowest client's rate, median over rounds
    aggregate_tokens_per_sec: float  # all tokens / wall time of a round, median over rounds
    ttft_p50_ms: float
    ttft_p99_ms: float


def stream_one(host: str, port: int, body: dict) -> Answer:
    """POST a streaming completion and read it to the end."""
    connection = http.client.HTTPConnection(host, port, timeout=600)
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {response.read()[:500]!r}")
    first, tokens = None, None
    for line in response:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if first is None and any(choice.get("text") for choice in chunk["choices"]):
            first = time.perf_counter()
    end = time.perf_counter()
    connection.close()
    if tokens is None or first is None:
        raise RuntimeError("the stream ended without text or usage")
    return Answer(tokens, first - start, end - start)


def run_round(host: str, port: int, clients: int, round_index: int, request: dict) -> tuple[list[Answer], float]:
    """``clients`` requests at once; their answers and the round's wall time."""
    answers: list[Answer | None] = [None] * clients
    errors: list[BaseException] = []
    barrier = threading.Barrier(clients)

    def client(index: int) -> None:
        body = request | {"prompt": PROMPT.format(client=index, round=round_index)}
        barrier.wait()
        try:
            answers[index] = stream_one(host, port, body)
        except BaseException as err:  # reported below, in the main thread
            errors.append(err)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [a for a in answers if a is not None], time.perf_counter() - start


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def measure(host: str, port: int, clients: int, rounds: int, request: dict) -> Load:
    run_round(host, port, clients, 99, request)  # warm-up: every shape the server runs for this load
    rates, slowest, aggregates, ttfts = [], [], [], []
    for round_index in range(rounds):
        answers, wall = run_round(host, port, clients, round_index, request)
        rates += [a.tokens_per_sec for a in answers]
        slowest.append(min(a.tokens_per_sec for a in answers))
        aggregates.append(sum(a.tokens for a in answers) / wall)
        ttfts += [a.ttft for a in answers]
    return Load(
        clients=clients,
        per_client_tokens_per_sec=statistics.median(rates),
        slowest_client_tokens_per_sec=statistics.median(slowest),
        aggregate_tokens_per_sec=statistics.median(aggregates),
        ttft_p50_ms=1e3 * percentile(ttfts, 0.5),
        ttft_p99_ms=1e3 * percentile(ttfts, 0.99),
    )


def gpt_fast(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpt_fast", *args]


def ensure_checkpoint(args: ServeBenchOptions) -> Path:
    folder = Path(args.workdir) / f"{args.shape}-{args.dtype}"
    if not (folder / "config.json").is_file():
        print(f"Writing a random {args.shape} checkpoint to {folder} ...", flush=True)
        command = gpt_fast("random-checkpoint", args.shape, "--output_dir", str(folder), "--dtype", args.dtype)
        subprocess.run([*command, "--device", args.device], check=True)
    return folder


def generate_rate(args: ServeBenchOptions, checkpoint: Path, sampling: list[str]) -> float:
    """`gpt-fast generate`'s average tokens/sec on the same prompt length, budget and sampling."""
    with tempfile.TemporaryDirectory() as scratch:
        metrics = Path(scratch) / "metrics.json"
        command = gpt_fast(
            "generate",
            "--checkpoint_path",
            str(checkpoint),
            "--prompt",
            PROMPT.format(client=0, round=0),
            "--max_new_tokens",
            str(args.max_tokens),
            "--num_samples",
            "4",
            "--ignore_eos",
            "--no_stream",
            "--compile",
            args.compile,
            "--device",
            args.device,
            "--metrics_json",
            str(metrics),
            *sampling,
        )
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return json.loads(metrics.read_text())["average_tokens_per_sec"]


class Server:
    """`gpt-fast serve` in a subprocess, until the block ends."""

    def __init__(self, args: ServeBenchOptions, checkpoint: Path, max_seq_length: int) -> None:
        self.command = gpt_fast(
            "serve",
            "--checkpoint_path",
            str(checkpoint),
            "--port",
            "0",
            "--max_batch",
            str(args.clients),
            "--max_seq_length",
            str(max_seq_length),
            "--compile",
            args.compile,
            "--device",
            args.device,
        )

    def __enter__(self) -> tuple[str, int]:
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True)
        for line in self.process.stdout:
            print(f"  server: {line.rstrip()}", flush=True)
            if line.startswith("Serving "):
                address = line.split(" at http://", 1)[1].split("/", 1)[0]
                host, port = address.rsplit(":", 1)
                threading.Thread(target=self.process.stdout.read, daemon=True).start()
                return host, int(port)
        raise RuntimeError(f"the server exited with status {self.process.wait()}")

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(60)


def table(generate: float, one: Load, many: Load) -> str:
    rows = [
        "| load | tok/s per client (median) | slowest client | aggregate tok/s | TTFT p50 | TTFT p99 |",
        "|---|---|---|---|---|---|",
        f"| `gpt-fast generate` | {generate:.1f} | | {generate:.1f} | | |",
    ]
    for load in (one, many):
        rows.append(
            f"| server, {load.clients} client{'s' if load.clients > 1 else ''} | "
            f"{load.per_client_tokens_per_sec:.1f} | {load.slowest_client_tokens_per_sec:.1f} | "
            f"{load.aggregate_tokens_per_sec:.1f} | {load.ttft_p50_ms:.1f} ms | {load.ttft_p99_ms:.1f} ms |"
        )
    aggregate = many.aggregate_tokens_per_sec / one.aggregate_tokens_per_sec
    slowest = many.slowest_client_tokens_per_sec / one.per_client_tokens_per_sec
    through = one.per_client_tokens_per_sec / generate
    rows += [
        "",
        f"aggregate with {many.clients} clients / one client: {aggregate:.2f}x (target >= 6x)",
        f"slowest of {many.clients} clients / one client: {100 * slowest:.0f} % (target >= 75 %)",
        f"one client through the server / gpt-fast generate: {100 * through:.0f} % (target >= 95 %)",
    ]
    return "\n".join(rows)


def run(options: ServeBenchOptions) -> None:
    """The benchmark of ``options`` (`gpt-fast bench serve`): one table on standard output."""
    workdir = options.workdir or str(Path(tempfile.gettempdir()) / "gpt-fast-bench-serve")
    args = replace(options, workdir=workdir)
    checkpoint = ensure_checkpoint(args)
    prompt_tokens = len(PROMPT.format(client=0, round=0).encode()) + 1  # byte-level tokenizer, BOS
    # the cache length `generate` uses for this request, so that both attend over as many positions
    max_seq_length = cache_length(prompt_tokens, args.max_tokens, get_shape(args.shape).block_size)
    sampling = ["--temperature", str(args.temperature), "--top_k", str(args.top_k)]
    print(f"gpt-fast generate ({args.compile}, {args.max_tokens} tokens) ...", flush=True)
    generate = generate_rate(args, checkpoint, sampling)
    request = {
        "model": checkpoint.name,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with Server(args, checkpoint, max_seq_length) as (host, port):
        print("1 client ...", flush=True)
        one = measure(host, port, 1, args.rounds, request)
        print(f"{args.clients} clients ...", flush=True)
        many = measure(host, port, args.clients, args.rounds, request)
    print(
        f"\n{args.shape} ({checkpoint}), {args.dtype}, compile={args.compile}, {args.device}, {args.max_tokens} "
        f"tokens per answer, prompts of {prompt_tokens} tokens, {args.clients} slots of {max_seq_length} tokens\n"
    )
    print(table(generate, one, many))
    if args.output:
        figures = {"args": asdict(args), "generate_tokens_per_sec": generate, "one": asdict(one), "many": asdict(many)}
        write_text_atomic(Path(args.output), json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":  # python -m gpt_fast.bench.serve: `gpt-fast bench serve`
    from gpt_fast.cli.bench import run_alias

    run_alias("serve")
