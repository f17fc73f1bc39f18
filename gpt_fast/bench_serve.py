"""`python -m gpt_fast.bench_serve`: an alias of `gpt-fast bench serve` (:mod:`gpt_fast.bench.serve`)."""

from gpt_fast.cli.bench import run_alias

if __name__ == "__main__":
    run_alias("serve")
