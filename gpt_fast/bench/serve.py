"""The server under load, in one run: `gpt-fast serve` with one streaming client and with each count of
``--clients`` at once, one run per count on one server (as many slots as the largest count), and with the fixed
workload `gpt-fast generate` alone first, on the same checkpoint, compile mode, sampling and request. Prints one
table, a row per run, and the issue's ratios.

    gpt-fast bench serve --shape llama-2-7b --compile reduce-overhead --clients 1,8,32,64
    gpt-fast bench serve --shape llama-2-7b --clients 8,32 --workload mixed --system_prompt_tokens 256

A random-weight checkpoint of ``--shape`` (byte-level tokenizer) is written to ``--workdir`` first, and kept for the
next run. The clients are plain HTTP (``http.client``) threads in this process; the server and `generate` each run
in a subprocess of their own. The requests are planned before a run (:mod:`gpt_fast.bench.workload`: the fixed
prompt text, or the mixed workload's random token ids and lengths); every answer runs to its planned length
(``ignore_eos``).

A run: every client sends one warm-up request, all at once; then, starting together, each sends ``--rounds``
requests one after another. Its figures: tokens/sec per client (the client's tokens over its time in requests; the
mean over clients, and the slowest) and in all (every token over the run's wall time); the time to the first token
and the inter-token latency at p50 and p99, the latter from the arrival of each piece of streamed text after the
first (as vLLM's and SGLang's benchmarks take it; a piece is one token unless the tokenizer held part of a
character back); and from the server's ``/health`` (the batcher's :class:`~gpt_fast.engine.batcher.CacheUsage`),
read before and after the run: the most KV blocks in use at one of its steps, the share of the prompt tokens looked
up in the prefix cache during the run that it held, and the preemptions.
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
from itertools import pairwise
from pathlib import Path

from gpt_fast.bench.options import ServeBenchOptions
from gpt_fast.bench.workload import Planned, fixed_prompt, longest_answer, longest_prompt, plan
from gpt_fast.engine.batcher import CacheUsage
from gpt_fast.generation.decode import cache_length
from gpt_fast.model.shapes import get_shape
from gpt_fast.util.fileio import write_text_atomic

# the aggregate over one client's that the server aims at, by clients (printed beside the figures)
AGGREGATE_TARGETS = {8: 6.5, 32: 18, 64: 25}


@dataclass(frozen=True)
class Answer:
    """One streamed answer, timed by its client from the moment the request was sent."""

    tokens: int
    ttft: float  # seconds to the first text
    seconds: float  # to the end
    gaps: tuple[float, ...]  # seconds between the arrivals of consecutive pieces of text


@dataclass(frozen=True)
class Load:
    """One run: ``clients`` streaming at once, ``requests`` answers timed. A latency is None where there is none to
    take (every answer one piece of text); ``prefix_hit_rate`` None where no prompt token was looked up."""

    clients: int
    requests: int
    per_client_tokens_per_sec: float  # mean over clients of a client's tokens / its seconds in requests
    slowest_client_tokens_per_sec: float  # the slowest client's
    aggregate_tokens_per_sec: float  # every token / the run's wall time
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    peak_blocks_used: int  # the most KV blocks in use when one of the run's steps was launched
    prefix_hit_rate: float | None  # prompt tokens found already computed / prompt tokens looked up, in the run
    preemptions: int  # during the run


def stream_one(host: str, port: int, body: dict) -> Answer:
    """POST a streaming completion and read it to the end; its answer must run to ``max_tokens``."""
    connection = http.client.HTTPConnection(host, port, timeout=600)
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"the server answered {response.status}: {response.read()[:500]!r}")
    arrivals: list[float] = []
    tokens = None
    for line in response:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if any(choice.get("text") for choice in chunk["choices"]):
            arrivals.append(time.perf_counter())
    end = time.perf_counter()
    connection.close()
    if tokens is None or not arrivals:
        raise RuntimeError("the stream ended without text or usage")
    if tokens != body["max_tokens"]:
        raise RuntimeError(f"asked for {body['max_tokens']} tokens (ignore_eos), the answer has {tokens}")
    gaps = tuple(later - earlier for earlier, later in pairwise(arrivals))
    return Answer(tokens, arrivals[0] - start, end - start, gaps)


def run_clients(host: str, port: int, planned: list[list[Planned]], request: dict) -> tuple[list[list[Answer]], float]:
    """Each client's planned requests, one after another, the clients starting at once: their answers, and the wall
    time to the last answer's end."""
    answers: list[list[Answer]] = [[] for _ in planned]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(planned))

    def client(index: int) -> None:
        barrier.wait()
        try:
            for one in planned[index]:
                body = request | {"prompt": one.prompt, "max_tokens": one.answer_tokens}
                answers[index].append(stream_one(host, port, body))
        except BaseException as err:  # reported below, in the main thread
            errors.append(err)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(planned))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return answers, time.perf_counter() - start


def read_cache(connection: http.client.HTTPConnection, reset_peak: bool = False) -> CacheUsage:
    """The server's cache now, from ``/health`` (``reset_peak``: its peak counted from this reading on)."""
    connection.request("GET", "/health?reset_peak=1" if reset_peak else "/health")
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"/health answered {response.status}: {response.read()[:500]!r}")
    return CacheUsage(**json.loads(response.read())["cache"])


class CacheReadings:
    """The server's cache (``/health``) read before a run, its peak reset, and after it: the counters at both ends,
    and the most blocks in use when any of the run's steps was launched (the batcher's own count, which readings
    between steps could miss for a short run)."""

    def __init__(self, host: str, port: int) -> None:
        self.connection = http.client.HTTPConnection(host, port, timeout=60)

    def __enter__(self) -> CacheReadings:
        self.before = read_cache(self.connection, reset_peak=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.after = read_cache(self.connection)
        self.connection.close()


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def milliseconds(values: list[float], share: float) -> float | None:
    return 1e3 * percentile(values, share) if values else None


def summarize(answers: list[list[Answer]], wall: float, cache: CacheReadings) -> Load:
    """A run's figures from each client's answers and the cache's readings."""
    every = [answer for client in answers for answer in client]
    rates = [sum(a.tokens for a in client) / sum(a.seconds for a in client) for client in answers]
    ttfts = [answer.ttft for answer in every]
    gaps = [gap for answer in every for gap in answer.gaps]
    before, after = cache.before, cache.after
    queried = after.prefix_tokens_queried - before.prefix_tokens_queried
    hit = after.prefix_tokens_hit - before.prefix_tokens_hit
    return Load(
        clients=len(answers),
        requests=len(every),
        per_client_tokens_per_sec=statistics.fmean(rates),
        slowest_client_tokens_per_sec=min(rates),
        aggregate_tokens_per_sec=sum(answer.tokens for answer in every) / wall,
        ttft_p50_ms=1e3 * percentile(ttfts, 0.5),
        ttft_p99_ms=1e3 * percentile(ttfts, 0.99),
        itl_p50_ms=milliseconds(gaps, 0.5),
        itl_p99_ms=milliseconds(gaps, 0.99),
        peak_blocks_used=after.blocks_peak,
        prefix_hit_rate=hit / queried if queried else None,
        preemptions=after.preemptions - before.preemptions,
    )


def measure(host: str, port: int, args: ServeBenchOptions, clients: int, request: dict) -> Load:
    """One run of ``clients``, after a warm-up request each (every shape the server runs for this load)."""
    run_clients(host, port, plan(args, clients, warm_up=True), request)
    with CacheReadings(host, port) as cache:
        answers, wall = run_clients(host, port, plan(args, clients), request)
    return summarize(answers, wall, cache)


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
            fixed_prompt(0, 0),
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
            "--kernel_tuning",
            args.kernel_tuning,
            "--kv_cache_dtype",
            args.kv_cache_dtype,
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
            str(max(args.counts)),
            "--max_seq_length",
            str(max_seq_length),
            "--compile",
            args.compile,
            "--device",
            args.device,
            "--kv_cache",
            args.kv_cache,
            "--kernel_tuning",
            args.kernel_tuning,
            "--kv_cache_dtype",
            args.kv_cache_dtype,
            *(() if args.step_sizes is None else ("--step_sizes", ",".join(map(str, args.step_sizes)))),
            *(() if args.kv_cache_memory is None else ("--kv_cache_memory", str(args.kv_cache_memory))),
        )

    def __enter__(self) -> tuple[str, int]:
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, text=True)
        try:
            return self._address()
        except BaseException:  # an interrupt, or a line not as expected: the server does not outlive the benchmark
            self.process.kill()
            self.process.wait()
            raise

    def _address(self) -> tuple[str, int]:
        """The server's output echoed until it says where it serves: its host and port."""
        for line in self.process.stdout:
            print(f"  server: {line.rstrip()}", flush=True)
            if line.startswith("Serving "):
                address = line.split(" at http://", 1)[1].split("/", 1)[0]
                host, port = address.rsplit(":", 1)
                threading.Thread(target=self._echo_cache_line, daemon=True).start()
                return host, int(port)
        raise RuntimeError(f"the server exited with status {self.process.wait()}")

    def _echo_cache_line(self) -> None:
        """The rest of the server's output, read so that it never blocks on a full pipe; its line saying the KV
        cache's size and dtype, which follows the address, echoed."""
        for line in self.process.stdout:
            if line.startswith("KV cache: "):
                print(f"  server: {line.rstrip()}", flush=True)

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        self.process.wait(60)


def cell(value: float | None, unit: str = "") -> str:
    return "–" if value is None else f"{value:.1f}{unit}"


def table(generate: float | None, loads: list[Load], blocks: int) -> str:
    """A row per run (and `generate`'s, where it ran), then each run's ratios to one client's."""
    one = loads[0]
    assert one.clients == 1, "every benchmark runs one client first, the ratios' baseline"
    rows = [
        "| load | requests | tok/s per client (mean) | slowest client | aggregate tok/s | TTFT p50 | TTFT p99 | "
        f"ITL p50 | ITL p99 | peak KV blocks (of {blocks}) | prefix cache hits | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if generate is not None:
        rows.append(f"| `gpt-fast generate` | | {generate:.1f} | | {generate:.1f} | | | | | | | |")
    for load in loads:
        hits = "–" if load.prefix_hit_rate is None else f"{100 * load.prefix_hit_rate:.0f} %"
        rates = (load.per_client_tokens_per_sec, load.slowest_client_tokens_per_sec, load.aggregate_tokens_per_sec)
        latencies = (load.ttft_p50_ms, load.ttft_p99_ms, load.itl_p50_ms, load.itl_p99_ms)
        cells = [
            f"server, {load.clients} client{'s' if load.clients > 1 else ''}",
            str(load.requests),
            *(cell(rate) for rate in rates),
            *(cell(latency, " ms") for latency in latencies),
            str(load.peak_blocks_used),
            hits,
            str(load.preemptions),
        ]
        rows.append(f"| {' | '.join(cells)} |")
    rows.append("")
    for many in loads[1:]:
        aggregate = many.aggregate_tokens_per_sec / one.aggregate_tokens_per_sec
        slowest = many.slowest_client_tokens_per_sec / one.per_client_tokens_per_sec
        ttft = many.ttft_p50_ms / one.ttft_p50_ms
        target = AGGREGATE_TARGETS.get(many.clients)
        eight = many.clients == 8
        rows += [
            f"aggregate with {many.clients} clients / one client: {aggregate:.2f}x"
            + ("" if target is None else f" (target >= {target}x)"),
            f"slowest of {many.clients} clients / one client: {100 * slowest:.0f} %" + (" (target >= 80 %)" * eight),
            f"TTFT p50 with {many.clients} clients / one client: {ttft:.2f}x" + (" (target <= 2x)" * eight),
        ]
    if generate is not None:
        through = one.per_client_tokens_per_sec / generate
        rows.append(f"one client through the server / gpt-fast generate: {100 * through:.0f} % (target >= 95 %)")
    return "\n".join(rows)


def workload_line(args: ServeBenchOptions) -> str:
    if args.workload == "fixed":
        return f"{args.max_tokens} tokens per answer, prompts of {longest_prompt(args)} tokens"
    system = f" after a shared system prompt of {args.system_prompt_tokens}" if args.system_prompt_tokens else ""
    prompts, answers = ("-".join(map(str, ends)) for ends in (args.prompt_tokens, args.answer_tokens))
    return f"mixed workload (seed {args.seed}): prompts of {prompts} tokens{system}, answers of {answers} tokens"


def run(options: ServeBenchOptions) -> None:
    """The benchmark of ``options`` (`gpt-fast bench serve`): one table on standard output."""
    workdir = options.workdir or str(Path(tempfile.gettempdir()) / "gpt-fast-bench-serve")
    args = replace(options, workdir=workdir)
    checkpoint = ensure_checkpoint(args)
    # the fixed workload: the cache length `generate` uses for this request, so that both attend over as many positions
    max_seq_length = cache_length(longest_prompt(args), longest_answer(args), get_shape(args.shape).block_size)
    sampling = ["--temperature", str(args.temperature), "--top_k", str(args.top_k)]
    generate = None
    if args.workload == "fixed":
        print(f"gpt-fast generate ({args.compile}, {args.max_tokens} tokens) ...", flush=True)
        generate = generate_rate(args, checkpoint, sampling)
    request = {
        "model": checkpoint.name,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    loads = []
    with Server(args, checkpoint, max_seq_length) as (host, port):
        connection = http.client.HTTPConnection(host, port, timeout=60)
        cache = read_cache(connection)
        connection.close()
        for count in args.counts:
            print(f"{count} client{'s' if count > 1 else ''} ...", flush=True)
            loads.append(measure(host, port, args, count, request))
    kv_dtype = "" if args.kv_cache_dtype == "auto" else f" ({args.kv_cache_dtype})"
    print(
        f"\n{args.shape} ({checkpoint}), {args.dtype}, compile={args.compile}, {args.device}, {workload_line(args)}, "
        f"{max(args.counts)} slots of {max_seq_length} tokens, KV blocks of {cache.block_size} tokens{kv_dtype}\n"
    )
    print(table(generate, loads, cache.blocks))
    if args.output:
        figures = {
            "args": asdict(args),
            "generate_tokens_per_sec": generate,
            "cache": {"block_size": cache.block_size, "blocks": cache.blocks},
            "runs": [asdict(load) for load in loads],
            "one": asdict(loads[0]),
            "many": asdict(loads[-1]),
        }
        write_text_atomic(Path(args.output), json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":  # python -m gpt_fast.bench.serve: `gpt-fast bench serve`
    from gpt_fast.cli.bench import run_alias

    run_alias("serve")
