"""`python -m gpt_fast.bench_serve`: an alias of `gpt-fast bench serve` (:mod:`gpt_fast.bench.serve`)."""

from gpt_fast.bench.serve import main

if __name__ == "__main__":
    main()
