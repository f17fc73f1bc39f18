"""For the tests that run our Triton kernels on the CPU, in Triton's interpreter (``TRITON_INTERPRET=1``): their
marks, and a record of the GEMVs a step called."""

import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

LAUNCHER = Path(__file__).with_name("interpreted.py")  # runs a kernel launch's helpers without re-patching Triton
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
old_numpy = pytest.mark.skipif(
    tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4),
    reason="Triton 3.6's interpreter takes int() of 1-element arrays, an error since numpy 2.4",
)


def gemv_calls() -> list[str]:
    """Record each call of our GEMVs as its kind ("linear_gemv normed", "... plus residual", "gated_gemv normed")."""
    from gpt_fast.kernels import triton_linear

    calls: list[str] = []
    for name in ("linear_gemv", "gated_gemv"):
        kernel = getattr(triton_linear, name)

        def spy(*args, name=name, kernel=kernel):
            normed = args[-2] is not None  # norm_weight
            added = name == "linear_gemv" and args[3] is not None  # residual
            calls.append(name + (" normed" if normed else "") + (" plus residual" if added else ""))
            return kernel(*args)

        setattr(triton_linear, name, spy)
    return calls


def interpret(*command: str, timeout: float = 600) -> str:
    """:func:`interpret_all` of one command: its standard output."""
    return interpret_all([command], timeout)[0]


def interpret_all(commands: Sequence[Sequence[str]], timeout: float = 600) -> list[str]:
    """Run Python with each of ``commands``' arguments (``["-c", code]``, or a script and its arguments) in a process
    of its own with ``TRITON_INTERPRET=1`` (read when the kernels are defined), through :data:`LAUNCHER`, all at
    once: the interpreter keeps one core busy per process, so the machine's cores share the work. Each one's standard
    output, in order; one that fails fails the test with the end of its standard error. Each process runs torch on
    one thread: the processes already share the cores, and more OpenMP threads than cores only wait on each other."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    processes = [subprocess.Popen([sys.executable, str(LAUNCHER), *command], **pipes) for command in commands]
    outputs = []
    for process in processes:
        out, err = process.communicate(timeout=timeout)
        assert process.returncode == 0, err[-2000:]
        outputs.append(out)
    return outputs
