"""The persistent layers kernel against the model's own layers, run as a script in a process of its own with
``TRITON_INTERPRET=1`` (the interpreter test: a launch per phase and layer) or imported on a GPU (the GPU test: one
launch). Prints, as JSON, the worst relative error of the residual and of the KV caches per dtype.

Cases: MHA and GQA; a step at the first position after a one-token prompt (most runs of the attention's positions
empty), in the middle and at the end of the cache; as many programs as heads, fewer, and more (several runs of
positions per head)."""

from __future__ import annotations

import copy
import json
import sys

import torch

from gpt_fast.accel import persistent
from gpt_fast.kernels import triton_persistent
from gpt_fast.model.config import ModelConfig
from gpt_fast.model.transformer import Transformer

CACHE = 64
# (kv heads, position of the step, programs)
CASES = [(4, 1, 16), (2, 30, 3), (2, 63, 4), (1, 9, 7)]


def tiny_model(n_kv: int, dtype: torch.dtype, device: str) -> Transformer:
    torch.manual_seed(n_kv)
    config = ModelConfig(
        block_size=CACHE, vocab_size=97, n_layer=2, n_head=4, dim=48, intermediate_size=40, n_local_heads=n_kv,
        head_dim=16, rope_base=10000.0, norm_eps=1e-5,
    )  # fmt: skip
    model = Transformer(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval().to(device=device, dtype=dtype)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


@torch.no_grad()
def case(n_kv: int, pos: int, programs: int, dtype: torch.dtype, device: str, phase_by_phase: bool) -> float:
    """The larger relative error of the residual after the layers and of the caches, kernel against model."""
    model = tiny_model(n_kv, dtype, device)
    model.setup_caches(1, CACHE)
    tokens = torch.randint(0, 97, (1, pos + 1), generator=torch.Generator().manual_seed(pos)).to(device)
    model(tokens[:, :pos], torch.arange(pos, device=device))
    reference = copy.deepcopy(model)
    at = torch.tensor([pos], device=device)
    x = model.tok_embeddings(tokens[:, pos:])
    cos, sin = reference.rope_cos[at], reference.rope_sin[at]
    mask = torch.where(torch.arange(CACHE, device=device) <= at[..., None], 0.0, float("-inf")).to(dtype)
    expected = x
    for layer in reference.layers:
        expected = layer(expected, cos, sin, mask, at)
    persistent.use_layers_kernel(model, "triton")  # the caches exist: the table is written now
    cfg = model.config
    got = triton_persistent.decode_layers(
        x, model.layers_table, at, model.rope_cos, model.rope_sin,
        (cfg.n_head, cfg.n_local_heads, cfg.head_dim, cfg.intermediate_size, CACHE), cfg.norm_eps,
        cfg.head_dim**-0.5, programs, phase_by_phase,
    )  # fmt: skip
    pairs = zip(model.layers, reference.layers, strict=True)
    caches = [relative_error(a.attention.kv_cache.kv, b.attention.kv_cache.kv) for a, b in pairs]
    return max(relative_error(got, expected), *caches)


def report(device: str, phase_by_phase: bool) -> dict[str, float]:
    return {
        str(dtype).removeprefix("torch."): max(case(*c, dtype, device, phase_by_phase) for c in CASES)
        for dtype in (torch.float32, torch.bfloat16)
    }


if __name__ == "__main__":
    json.dump(report("cpu", phase_by_phase=True), sys.stdout)
