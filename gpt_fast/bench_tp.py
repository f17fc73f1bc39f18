"""`python -m gpt_fast.bench_tp`: an alias of `gpt-fast bench tp` (:mod:`gpt_fast.bench.tp`)."""

from gpt_fast.bench.tp import main

if __name__ == "__main__":
    main()
