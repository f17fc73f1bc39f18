"""The embedded default model through `gpt-fast serve`, source trees or options side by side in alternating server
processes (A B A B ...), so that the machine's drift falls on every side alike. Each server answers one streamed
request three times (time to first token, tokens/sec after it), then 4 requests one after another against the same
4 at once, twice: issue 62's CPU figure is the second's ratio (4 at once at least 3x faster). Greedy, every answer
runs to ``--tokens``. Prints a line per measurement and each side's medians.

usage: python scripts/serve_ab.py [--rounds N] [--tokens N] [--serve_args ARGS] SIDE [SIDE ...]
  SIDE: NAME=TREE or NAME=TREE;ARGS, TREE a folder holding a gpt_fast package (this checkout, or an older commit's
  `git archive COMMIT gpt_fast | tar -x -C /tmp/old`), ARGS more `gpt-fast serve` options for that side, e.g.
  python scripts/serve_ab.py --rounds 3 --serve_args "--quant_kernel cpp-q8" \\
      base=/tmp/old f32=. "f16=.;--kv_cache_dtype float16"
Each tree builds its C++ kernels once into its own TORCH_EXTENSIONS_DIR (under ~/.cache/gpt-fast-ab/).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

START_SECONDS = 300  # a tree's first start builds its kernels and converts the default model


@dataclass
class Side:
    name: str
    tree: Path
    args: list[str]
    figures: dict[str, list[float]] = field(default_factory=dict)

    def add(self, figure: str, value: float) -> None:
        self.figures.setdefault(figure, []).append(value)


def parse_side(text: str) -> Side:
    name, sep, rest = text.partition("=")
    tree, _, args = rest.partition(";")
    if not sep or not name or not (Path(tree) / "gpt_fast").is_dir():
        raise SystemExit(f"side {text!r}: expected NAME=TREE[;ARGS] with TREE holding a gpt_fast package")
    return Side(name, Path(tree).resolve(), shlex.split(args))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def greedy_request(port: int, model: str, prompt: str, tokens: int, stream: bool) -> urllib.request.Request:
    """A completions request for ``tokens`` greedy tokens, run to their length."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    data = json.dumps({**body, "stream": stream}).encode()
    headers = {"content-type": "application/json"}
    return urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data, headers)


def completion(port: int, model: str, prompt: str, tokens: int) -> int:
    """One greedy completion of ``tokens`` tokens; the count the server reports."""
    with urllib.request.urlopen(greedy_request(port, model, prompt, tokens, stream=False)) as response:
        return json.load(response)["usage"]["completion_tokens"]


def stream(port: int, model: str, prompt: str, tokens: int) -> tuple[float, float]:
    """One streamed greedy completion: (ms to the first piece, pieces per second after it)."""
    start, first, pieces = time.perf_counter(), None, 0
    with urllib.request.urlopen(greedy_request(port, model, prompt, tokens, stream=True)) as response:
        for line in response:
            if line.startswith(b"data: {"):
                pieces += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    assert first is not None, "the stream sent no piece"
    return 1e3 * (first - start), (pieces - 1) / (end - first)


def wait_until_serving(process: subprocess.Popen, log: Path) -> str:
    """The server's first line once it serves ("Serving ... slots ..."); exits if the server did."""
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines() if log.exists() else []
        serving = [line for line in lines if line.startswith("Serving")]
        if serving:
            return serving[0]
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}):\n{log.read_text()}")
        time.sleep(1)
    raise SystemExit(f"the server did not start within {START_SECONDS} s:\n{log.read_text()}")


def measure(side: Side, serve_args: list[str], tokens: int, log: Path) -> None:
    port = free_port()
    ext = Path.home() / ".cache" / "gpt-fast-ab" / hashlib.sha1(str(side.tree).encode()).hexdigest()[:12]
    env = {**os.environ, "PYTHONPATH": str(side.tree), "TORCH_EXTENSIONS_DIR": str(ext), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "gpt_fast", "serve", "--port", str(port), *serve_args, *side.args]
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    try:
        print(f"  {side.name}: {wait_until_serving(process, log)}", flush=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as response:
            model = json.load(response)["data"][0]["id"]
        measure_server(side, port, model, tokens)
    finally:
        process.terminate()
        process.wait(60)


def measure_server(side: Side, port: int, model: str, tokens: int) -> None:
    for n in range(3):
        ttft, rate = stream(port, model, f"Write story {n} about a cat.", tokens)
        side.add("one stream tok/s", rate)
        print(f"  {side.name}: one stream, first token {ttft:.0f} ms, then {rate:.1f} tok/s", flush=True)
    prompts = [f"Write a story number {i} about a cat." for i in range(4)]
    completion(port, model, "Write a story number 9 about a cat.", tokens)  # the 4-row step's first use
    for _ in range(2):
        start = time.perf_counter()
        done = sum(completion(port, model, prompt, tokens) for prompt in prompts)
        one_by_one = time.perf_counter() - start
        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            done_at_once = sum(pool.map(lambda prompt: completion(port, model, prompt, tokens), prompts))
        at_once = time.perf_counter() - start
        assert done == done_at_once == len(prompts) * tokens, (done, done_at_once)
        for figure, value in (("one after another s", one_by_one), ("4 at once s", at_once)):
            side.add(figure, value)
        side.add("ratio", one_by_one / at_once)
        print(
            f"  {side.name}: 4 one after another {one_by_one:.2f} s, 4 at once {at_once:.2f} s: "
            f"{one_by_one / at_once:.2f}x",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sides", nargs="+", type=parse_side)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--serve_args", default="", help="gpt-fast serve options for every side")
    args = parser.parse_args()
    logs = Path.home() / ".cache" / "gpt-fast-ab" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for round_ in range(1, args.rounds + 1):
        print(f"round {round_} ({time.strftime('%H:%M:%S', time.gmtime())} UTC)", flush=True)
        for side in args.sides:
            measure(side, shlex.split(args.serve_args), args.tokens, logs / f"{side.name}.log")
    print("medians (min-max):")
    for side in args.sides:
        parts = [
            f"{figure} {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
            for figure, values in side.figures.items()
        ]
        print(f"  {side.name}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
