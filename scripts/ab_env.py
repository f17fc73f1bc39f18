"""A/B of environment settings on one machine: the same `gpt-fast generate` command run under each setting in turn,
in fresh processes, alternating (A B C A B C ...) so that the machine's load falls on every setting alike. Prints
each run's average tokens/sec and time to the first token (the command's own summary lines) and the medians.

usage: python scripts/ab_env.py ROUNDS SETTING [SETTING ...] -- COMMAND...
  SETTING: NAME=VALUE[,NAME=VALUE...] added to the environment, or "-" for none, e.g.
  python scripts/ab_env.py 3 OMP_NUM_THREADS=1 OMP_NUM_THREADS=2 OMP_NUM_THREADS=2,OMP_WAIT_POLICY=PASSIVE -- \\
      gpt-fast generate --temperature 0 --max_new_tokens 64 --num_samples 3
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys

FIGURES = {
    "tok/s": re.compile(r"^Average tokens/sec.*: ([0-9.]+)", re.M),
    "TTFT ms": re.compile(r"^Average time to first token.*: ([0-9.]+) ms", re.M),
}


def parse_setting(text: str) -> dict[str, str]:
    """``A=1,B=x`` -> {"A": "1", "B": "x"}; ``-`` -> {}."""
    if text == "-":
        return {}
    pairs = [item.split("=", 1) for item in text.split(",")]
    if any(len(pair) != 2 or not pair[0] for pair in pairs):
        raise SystemExit(f"error: setting {text!r} is not NAME=VALUE[,NAME=VALUE...] or -")
    return dict(pairs)


def run_once(command: list[str], setting: dict[str, str]) -> dict[str, float]:
    """One run of ``command`` with ``setting`` added to the environment: its figures (empty if it failed)."""
    done = subprocess.run(command, env={**os.environ, **setting}, capture_output=True, text=True)
    if done.returncode:
        print(f"  failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}", flush=True)
        return {}
    return {name: float(m.group(1)) for name, pattern in FIGURES.items() if (m := pattern.search(done.stdout))}


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") < 2 or not argv[0].isdigit():
        raise SystemExit(__doc__)
    split = argv.index("--")
    rounds, names, command = int(argv[0]), argv[1:split], argv[split + 1 :]
    settings = [parse_setting(name) for name in names]
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_ in range(1, rounds + 1):
        for name, setting in zip(names, settings, strict=True):
            figures = run_once(command, setting)
            results[name].append(figures)
            print(f"round {round_} {name}: {figures}", flush=True)
    print("\n| setting | " + " | ".join(f"{f} (median; runs)" for f in FIGURES) + " |")
    print("|---|" + "---|" * len(FIGURES))
    for name in names:
        cells = []
        for figure in FIGURES:
            values = [run[figure] for run in results[name] if figure in run]
            median = f"{statistics.median(values):.1f}" if values else "—"
            cells.append(f"{median}; {', '.join(f'{v:.1f}' for v in values)}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
