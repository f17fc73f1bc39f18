"""Time one mixture-of-experts layer's decode step (batch 1) on a GPU, compiled as ``gpt-fast`` compiles it
(``reduce-overhead``: a CUDA graph), in two formulations of the chosen experts' products:

- ``einsum``: the model's own code, ``einsum`` over the gathered expert weights ``w13[ids]`` (inductor turns the
  gather and the batched product into one reduction that reads the two chosen experts in place);
- ``explicit``: the same products written as a broadcast multiply and a sum over the gathered weights.

Four layers of random weights of the ``--shape`` (11 GB for Mixtral-8x7B: far beyond L2), chained, timed over
``--calls`` replays (200). GB/s counts the chosen experts' bytes only. Timing only: the layer's
results are checked against transformers' by the CPU tests (``tests/test_families.py``); chained random layers
route differently on any rounding difference, so their outputs are not compared here.

    PYTHONPATH=. python scripts/moe_decode_layer.py [--shape mixtral-8x7b]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from gpt_fast.generation.decode import compile_options
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import MoEFeedForward, gated
from gpt_fast.util.device import device_synchronize
from gpt_fast.util.settings import apply_torch_settings

LAYERS = 4


def explicit(self: MoEFeedForward, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``MoEFeedForward.chosen_experts`` as a multiply and a sum: ``x`` [N, D], ``weights``, ``ids`` [N, k]."""
    inter = self.config.intermediate_size
    hidden = (x[:, None, None, :] * self.w13[ids]).sum(-1)  # [N, k, 2I]
    hidden = gated(hidden[..., :inter], hidden[..., inter:], self.config.mlp_activation)  # [N, k, I]
    out = (hidden[:, :, None, :] * self.w2[ids]).sum(-1)  # [N, k, D]
    return (out * weights[..., None].to(out.dtype)).sum(dim=1)


def time_per_call(step: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, calls: int) -> float:
    for _ in range(10):
        step(x)
    device_synchronize(x.device)
    start = time.perf_counter()
    for _ in range(calls):
        step(x)
    device_synchronize(x.device)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="mixtral-8x7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    apply_torch_settings()
    config = get_shape(args.shape)
    device = torch.device(args.device)
    with device:
        layers = [MoEFeedForward(config).to(torch.bfloat16) for _ in range(LAYERS)]
    for layer in layers:
        for weight in (layer.w13, layer.w2, layer.router.weight):
            torch.nn.init.normal_(weight, std=config.dim**-0.5)

    def step(x: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x)
        return x

    chosen_bytes = LAYERS * config.n_active_experts * 3 * config.intermediate_size * config.dim * 2
    original = MoEFeedForward.chosen_experts
    x = torch.randn(1, 1, config.dim, device=device, dtype=torch.bfloat16)  # [B, T, D]
    for name, chosen in (("einsum", original), ("explicit", explicit)):
        MoEFeedForward.chosen_experts = chosen
        torch._dynamo.reset()
        compiled = torch.compile(step, options=compile_options("reduce-overhead"), fullgraph=True)
        with torch.no_grad():
            start = time.perf_counter()
            compiled(x)
            compile_seconds = time.perf_counter() - start
            seconds = time_per_call(compiled, x, args.calls)
        print(
            f"{args.shape} {name}: {seconds * 1e6 / LAYERS:.1f} us per layer, {chosen_bytes / seconds / 1e9:.0f} "
            f"GB/s of the chosen experts; first call (compiles) {compile_seconds:.1f} s",
            flush=True,
        )
    MoEFeedForward.chosen_experts = original


if __name__ == "__main__":
    main()
