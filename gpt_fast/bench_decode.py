"""`python -m gpt_fast.bench_decode`: an alias of `gpt-fast bench decode` (:mod:`gpt_fast.bench.decode`)."""

from gpt_fast.bench.decode import main

if __name__ == "__main__":
    main()
