"""`python -m gpt_fast.bench_speculative`: an alias of `gpt-fast bench speculative`
(:mod:`gpt_fast.bench.speculative`)."""

from gpt_fast.cli.bench import run_alias

if __name__ == "__main__":
    run_alias("speculative")
