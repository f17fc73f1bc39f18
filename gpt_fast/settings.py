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
