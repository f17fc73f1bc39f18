"""Decode speed with and without a constraint, through the batcher `gpt-fast serve` runs, on random weights of a
named shape (written once to ``--output_dir``, with the byte-level tokenizer of random checkpoints):

- one request alone: plain, then held to a JSON schema (an array of at least 100 objects of a name, an age within
  bounds and a colour of three; the random model writes it for all its tokens);
- a full batch of plain requests, then the same beside one constrained request: the plain ones' speed.

Each figure is tokens per second of decode (after the first token) per request, the median of ``--rounds``.

    .venv/bin/python scripts/constrained_decode_cost.py --shape smollm2-135m --device cpu
    python scripts/constrained_decode_cost.py --shape llama-2-7b --device cuda --compile reduce-overhead
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from gpt_fast import Engine, EngineOptions, SamplingConfig
from gpt_fast.convert.random_init import random_shape_folder
from gpt_fast.engine.batcher import Batcher, Finished, Request
from gpt_fast.engine.options import BatchOptions
from gpt_fast.generation.options import OutputConstraint
from gpt_fast.util.device import resolve_device

PEOPLE = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "colour": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "colour"],
        "additionalProperties": False,
    },
}


def decode_rates(batcher: Batcher, requests: list[Request]) -> list[float]:
    """Each request's decode tokens per second, all submitted at once."""
    ends: dict[int, Finished] = {}
    for index, request in enumerate(requests):
        batcher.submit(
            request, lambda event, index=index: ends.setdefault(index, event) if isinstance(event, Finished) else None
        )
    batcher.run()
    return [(len(end.ids) - 1) / (end.seconds - end.ttft_seconds) for _, end in sorted(ends.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--device", default=None)
    parser.add_argument("--compile", default="none")
    parser.add_argument("--kernel_tuning", default="coordinate-descent")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output_dir", type=Path, default=Path("checkpoints/random"))
    args = parser.parse_args()
    device = resolve_device(args.device)
    folder = random_shape_folder(args.shape, args.output_dir, device)
    engine = Engine.open(
        folder, EngineOptions(compile=args.compile, device=args.device, kernel_tuning=args.kernel_tuning)
    )
    engine.load_weights()
    batcher = engine.batcher(BatchOptions(max_batch=args.slots, max_seq_length=args.tokens + 64))
    start = time.perf_counter()
    batcher.warm_up(constrained=True)
    print(
        f"{args.shape} on {engine.device_name}, {engine.dtype_name}, compile={args.compile}, torch {torch.__version__}"
    )
    print(f"warm-up (plain and masked steps): {time.perf_counter() - start:.1f} s")
    prompt = tuple(engine.encode("People: "))
    plain = Request(prompt, args.tokens, SamplingConfig(temperature=1.0), seed=1, ignore_eos=True)
    held = Request(
        prompt, args.tokens, SamplingConfig(temperature=1.0), seed=2, constraint=OutputConstraint.from_schema(PEOPLE)
    )
    loads = {
        "1 request, plain": [plain],
        "1 request, held to the schema": [held],
        f"{args.slots} plain requests": [plain] * args.slots,
        f"{args.slots - 1} plain beside 1 held": [held] + [plain] * (args.slots - 1),
    }
    print("| load | plain tok/s per request | held tok/s |")
    print("|---|---|---|")
    for label, requests in loads.items():
        rounds = [decode_rates(batcher, requests) for _ in range(args.rounds)]
        plain_rates = [
            rate for rates in rounds for rate, r in zip(rates, requests, strict=True) if r.constraint is None
        ]
        held_rates = [rate for rates in rounds for rate, r in zip(rates, requests, strict=True) if r.constraint]
        shown = [f"{statistics.median(rates):.1f}" if rates else "" for rates in (plain_rates, held_rates)]
        print(f"| {label} | {shown[0]} | {shown[1]} |")


if __name__ == "__main__":
    main()
