"""Process-wide torch settings. Only the command-line entry points call :func:`apply_torch_settings`."""

from __future__ import annotations


def apply_torch_settings() -> None:
    """Inductor settings for generation: coordinate-descent tuning of the generated kernels (decode is made of
    matrix-vector products and reductions whose block sizes it tunes), readable kernel names in traces, and the
    on-disk FX graph cache so a second process starts warm."""
    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = True
    inductor_config.triton.unique_kernel_names = True
    inductor_config.fx_graph_cache = True
    _use_workers_ptxas()


def _use_workers_ptxas() -> None:
    """Point Triton at the ptxas inductor's compile workers use (the one inside torch's wheel, where there is one).

    The workers set it for themselves, this process did not: coordinate-descent tuning, which compiles here, then
    built its winning kernels with Triton's own ptxas, whose version is part of Triton's cache key — so the next
    process, which loads kernels the workers' way, missed the cache and compiled every tuned kernel again
    (measured on an H200 with torch 2.11: 24 kernels, +2.4 s, on the first warm start of the SmolLM2 shape)."""
    from torch._inductor.runtime import compile_tasks

    pin = getattr(compile_tasks, "_set_triton_ptxas_path", None)
    if pin is not None:
        pin()
