"""Where a compile's time goes: runs a `gpt-fast` command in this process and logs every Triton compilation in it
(kernel, warps, stages, seconds, Triton's cache key), every lookup in inductor's autotune cache (hit or miss, and the
file it is kept in), every coordinate-descent tuning of a kernel (seconds, the configurations it started from and
ended with), then torch's own compile phases (``torch._dynamo.utils.compile_times``) and the process's wall time.

    python scripts/compile_log.py LOG generate --compile reduce-overhead --checkpoint_path CKPT ...

Compilations in inductor's worker processes are not seen: the ones logged are those of this process, where
coordinate-descent tuning compiles its candidates and where a warm start loads its kernels. Two warm starts of the
same command should log the same Triton cache keys; a warm start that compiles (seconds rather than milliseconds per
kernel) missed Triton's cache. Wraps private inductor functions: written for torch 2.11 to 2.13.
"""

from __future__ import annotations

import atexit
import runpy
import sys
import time
from typing import Any, TextIO

import torch._dynamo.utils as dynamo_utils
import torch._inductor.runtime.triton_heuristics as heuristics
import triton


def log_triton_compiles(log: TextIO) -> None:
    compile_kernel = triton.compile

    def logged(source: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        kernel = compile_kernel(source, *args, **kwargs)
        options = kwargs.get("options", {})
        log.write(
            f"triton.compile {time.perf_counter() - start:.3f}s {getattr(source.fn, '__name__', '?')} "
            f"warps={options.get('num_warps')} stages={options.get('num_stages')} key={kernel.hash}\n"
        )
        return kernel

    triton.compile = logged


def log_autotune_cache(log: TextIO) -> None:
    check = heuristics.check_autotune_cache

    def logged(configs: list[Any], filename: str | None, inductor_meta: dict[str, Any]) -> Any:
        result = check(configs, filename, inductor_meta)
        state = result[2].get("autotune_cache_state")
        log.write(f"autotune_cache {state} {inductor_meta.get('kernel_name')} configs={len(configs)} file={filename}\n")
        return result

    heuristics.check_autotune_cache = logged


def log_coordinate_descent(log: TextIO) -> None:
    tune = heuristics.CachingAutotuner._coordinate_descent_tuning

    def logged(self: Any, launcher: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        winner = tune(self, launcher, *args, **kwargs)
        log.write(
            f"coordinate_descent {time.perf_counter() - start:.3f}s {self.inductor_meta.get('kernel_name')} "
            f"from={launcher.config} to={winner.config} saved={self.save_cache_hook is not None}\n"
        )
        return winner

    heuristics.CachingAutotuner._coordinate_descent_tuning = logged


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python scripts/compile_log.py LOG GPT_FAST_COMMAND [ARGS...]")
    start = time.perf_counter()
    log = open(sys.argv[1], "a", buffering=1)  # open until the command exits: atexit writes the phases
    log_triton_compiles(log)
    log_autotune_cache(log)
    log_coordinate_descent(log)

    def phases() -> None:
        log.write(dynamo_utils.compile_times(repr="str", aggregate=True) + "\n")
        log.write(f"process wall {time.perf_counter() - start:.2f}s\n")

    atexit.register(phases)
    sys.argv = ["gpt_fast", *sys.argv[2:]]
    runpy.run_module("gpt_fast", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
