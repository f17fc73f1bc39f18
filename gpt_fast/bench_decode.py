"""`python -m gpt_fast.bench_decode`: an alias of `gpt-fast bench decode` (:mod:`gpt_fast.bench.decode`)."""

from gpt_fast.cli.bench import run_alias

if __name__ == "__main__":
    run_alias("decode")
