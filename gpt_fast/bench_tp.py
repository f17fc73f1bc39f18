"""`python -m gpt_fast.bench_tp`: an alias of `gpt-fast bench tp` (:mod:`gpt_fast.bench.tp`)."""

from gpt_fast.cli.bench import run_alias

if __name__ == "__main__":
    run_alias("tp")
