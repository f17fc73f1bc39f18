"""Eager CPU decode of the default model's forms side by side in one process (docs/bench/HISTORY.md, 2026-11-29, the
CPU's quantized products): every variant loaded once, run in turn, the order reversed every other round, at 1 and 2
threads; tok/s of greedy tokens after "Hello, my name is".

    gpt-fast convert SmolLM2-135M-Instruct.Q4_1.gguf --quantize int4 --group_size 32 --output_dir /tmp/int4
    gpt-fast quantize --mode int8 --output_dir /tmp/int8
    gpt-fast quantize --mode int8 --quantize_output --output_dir /tmp/int8o
    python scripts/cpu_quant_ab.py --int4 /tmp/int4 --int8 /tmp/int8 --int8_head /tmp/int8o --rounds 3
"""

import argparse
import statistics

import torch

from gpt_fast.accel.options import KernelOptions
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.options import SamplingConfig

GREEDY = SamplingConfig(temperature=0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--int4", required=True)
    parser.add_argument("--int8", required=True)
    parser.add_argument("--int8_head", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    slow = max(1, args.tokens // 4)  # PyTorch's own kernels: scalar on AVX2
    variants = [
        ("float32", None, "dequant", args.tokens),
        ("int4 from Q4_1, ours", args.int4, "cpp", args.tokens),
        ("int8, ours", args.int8, "cpp", args.tokens),
        ("int8 with its head, ours", args.int8_head, "cpp", args.tokens),
        ("int4 from Q4_1, aten", args.int4, "aten", slow),
        ("int8, aten", args.int8, "aten", slow),
    ]
    engines = {}
    for name, checkpoint, kernel, _ in variants:
        engines[name] = Engine.open(checkpoint, EngineOptions(device="cpu", kernels=KernelOptions(quant=kernel)))
        engines[name].load_weights()
    ids = engines["float32"].encode("Hello, my name is", chat=False)
    for engine in engines.values():
        engine.generate_ids(ids, 4, GREEDY, ignore_eos=True)
    rates = {}
    for round_ in range(args.rounds):
        for threads in (1, 2) if round_ % 2 == 0 else (2, 1):
            torch.set_num_threads(threads)
            for name, _, _, tokens in variants if round_ % 2 == 0 else variants[::-1]:
                result = engines[name].generate_ids(ids, tokens, GREEDY, ignore_eos=True)
                rates.setdefault((name, threads), []).append(tokens / result.seconds)
                print(round_, threads, name, f"{tokens / result.seconds:.2f}", flush=True)
    print("| variant | 1 thread tok/s | 2 threads tok/s |\n|---|---|---|")
    for name, *_ in variants:
        print(f"| {name} | " + " | ".join(f"{statistics.median(rates[(name, t)]):.2f}" for t in (1, 2)) + " |")


if __name__ == "__main__":
    main()
