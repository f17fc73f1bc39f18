"""For the tests that run our Triton kernels on the CPU, in Triton's interpreter (``TRITON_INTERPRET=1``): their
marks, and a record of the GEMVs a step called."""

import importlib.util

import numpy as np
import pytest

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
