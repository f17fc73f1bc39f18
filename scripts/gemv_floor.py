"""How fast can one decode matrix-vector product go? Times x [1, K] @ W[N, K]^T in bf16 for the weight shapes of
Llama-2-7B and Llama-3-8B, with cuBLAS (eager ``F.linear``) and with inductor's kernels, each inside a CUDA graph.

    python scripts/gemv_floor.py wqkv,w13,w2,wo,out32k cublas,cdt,cdt2,mat

Variants: ``cublas`` (eager), ``cdt`` (inductor with coordinate-descent tuning, which turns an M=1 matmul into a
tuned Triton reduction — gpt-fast's setting), ``cdt2`` (search radius 2), ``cdtall`` (all directions), ``mat``
(max-autotune GEMM templates against cuBLAS, no coordinate descent). Each shape rotates over enough weight copies
(>= 400 MB) that no copy stays in L2 between its uses. Prints one JSON line per shape and variant.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import weight_shapes
from gpt_fast.util.settings import apply_torch_settings

MATRICES = {  # name: (model shape, weight)
    "wqkv": ("llama-2-7b", "layers.0.attention.wqkv.weight"),
    "wo": ("llama-2-7b", "layers.0.attention.wo.weight"),
    "w13": ("llama-2-7b", "layers.0.feed_forward.w13.weight"),
    "w2": ("llama-2-7b", "layers.0.feed_forward.w2.weight"),
    "out32k": ("llama-2-7b", "output.weight"),
    "l3_wqkv": ("llama-3-8b", "layers.0.attention.wqkv.weight"),
    "l3_w13": ("llama-3-8b", "layers.0.feed_forward.w13.weight"),
    "l3_w2": ("llama-3-8b", "layers.0.feed_forward.w2.weight"),
    "l3_out": ("llama-3-8b", "output.weight"),
}
VARIANTS = ("cublas", "cdt", "cdt2", "cdtall", "mat")
ROTATION_BYTES = 400_000_000
REPS = 10  # passes over the copies inside one graph


def microseconds_per_call(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], weights: list[torch.Tensor], x: torch.Tensor
) -> float:
    """Capture REPS passes over ``weights`` in a CUDA graph and time three replays with events."""
    for w in weights:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            for w in weights:
                fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (3 * REPS * len(weights))


def variant_fn(variant: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    torch._dynamo.reset()
    if variant == "cublas":
        return F.linear
    inductor_config.coordinate_descent_tuning = variant.startswith("cdt")
    inductor_config.coordinate_descent_search_radius = 2 if variant == "cdt2" else 1
    inductor_config.coordinate_descent_check_all_directions = variant == "cdtall"
    inductor_config.max_autotune = inductor_config.max_autotune_gemm = variant == "mat"
    return torch.compile(lambda x, w: F.linear(x, w), dynamic=False)


def main(names: list[str], variants: list[str]) -> None:
    unknown = [n for n in names if n not in MATRICES] + [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(
            f"unknown shapes or variants: {', '.join(unknown)}; shapes: {', '.join(MATRICES)}; variants: "
            f"{', '.join(VARIANTS)}"
        )
    if not torch.cuda.is_available():
        raise SystemExit("gemv_floor.py needs a CUDA or ROCm GPU")
    apply_torch_settings()
    for name in names:
        model_shape, weight = MATRICES[name]
        n, k = weight_shapes(get_shape(model_shape))[weight]
        nbytes = n * k * 2
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, -(-ROTATION_BYTES // nbytes)))
        ]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        for variant in variants:
            start = time.perf_counter()
            us = microseconds_per_call(variant_fn(variant), weights, x)
            print(
                json.dumps(
                    {
                        "shape": name,
                        "variant": variant,
                        "us": us,
                        "GBps": nbytes / us / 1e3,
                        "setup_s": time.perf_counter() - start,
                    }
                ),
                flush=True,
            )
        del weights


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1].split(","), sys.argv[2].split(","))
