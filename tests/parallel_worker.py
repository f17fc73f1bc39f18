"""One rank of the tensor-parallel tests (run by torchrun from tests/test_parallel.py). Its single argument is a
JSON file of instructions; rank 0 writes what the ranks produced to ``out``:

- ``checkpoints``: for each checkpoint folder, the greedy tokens of ``prompt`` and the logits of ``window`` (one
  forward pass), and a sampled generation (every rank must draw the same tokens);
- ``shape`` (GPU): a random model of a named shape, the same on every rank, split over the ranks and, on rank 0,
  also whole on one GPU: how far the split model's greedy tokens and logits are from the whole model's (both with
  the kernel choices ``kernels``, if given);
- ``fused``: a random tiny model of that config (a dict), split, with our fused GEMVs in Triton's interpreter
  (``TRITON_INTERPRET=1``): for each rank, in rank order, how far its compiled one-token step's logits are from the
  whole model's own and which products its kernels made;
- ``fail_rank``: that rank raises once the weights are loaded, while the others generate.

Each rank then leaves the group, and fails if gloo's threads outlive that (something still held the group).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.parallel.tensor_parallel import leave

GREEDY = SamplingConfig(temperature=0)


@torch.no_grad()
def logits_of(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The model's logits [T, V] (float32, CPU) for ``ids`` from position 0, one forward pass."""
    model = engine.model
    model.setup_caches(1, 64 * (len(ids) // 64 + 1))
    window = torch.tensor([ids], device=engine.device)
    return model(window, torch.arange(len(ids), device=engine.device))[0].float().cpu()


def run_checkpoints(spec: dict) -> dict:
    results = {}
    for folder in spec["checkpoints"]:
        engine = Engine.load(folder, compile=spec["compile"], device="cpu", tp=spec["tp"])
        if int(os.environ["RANK"]) == spec.get("fail_rank"):
            raise RuntimeError(f"rank {os.environ['RANK']} fails on purpose")
        tokens = engine.generate_ids(spec["prompt"], spec["new_tokens"], GREEDY, ignore_eos=True).tokens[0]
        sampled = engine.generate_ids(spec["prompt"], spec["new_tokens"], SamplingConfig(), ignore_eos=True)
        results[folder] = {
            "tokens": tokens,
            "sampled": sampled.tokens[0],
            "logits": logits_of(engine, spec["window"]).tolist(),
        }
    return results


def run_shape(spec: dict) -> dict | None:
    """The split model and the whole one (rank 0), on GPUs in bf16 (``compile`` mode), each against the whole model
    in float32 on the same weights (eager): how far each one's logits are from it, and how far below its best logit
    each greedy token of the split model is."""
    from gpt_fast.convert.random_init import random_weights
    from gpt_fast.model.shapes import get_shape

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    shape = get_shape(spec["shape"])
    state = random_weights(shape, torch.bfloat16, seed=0, device="cuda")
    kernels = spec.get("kernels", {})  # EngineOptions' kernel choices, for the split and the whole bf16 model
    options = EngineOptions(compile=spec["compile"], device="cuda", dtype="bfloat16", tp=spec["tp"], **kernels)
    split = Engine.from_state(shape, state, options)
    tokens = split.generate_ids(spec["prompt"], spec["new_tokens"], GREEDY).tokens[0]
    ids = spec["prompt"] + tokens
    split_logits = logits_of(split, ids)
    if split.rank != 0:
        return None
    local = f"cuda:{os.environ['LOCAL_RANK']}"
    options = EngineOptions(compile=spec["compile"], device=local, dtype="bfloat16", **kernels)
    whole = Engine.from_state(shape, state, options)
    whole_tokens = whole.generate_ids(spec["prompt"], spec["new_tokens"], GREEDY).tokens[0]
    whole_logits = logits_of(whole, ids)
    del whole
    exact_state = {name: tensor.float() for name, tensor in state.items()}
    exact = Engine.from_state(shape, exact_state, EngineOptions(device=local, dtype="float32"))
    exact_logits = logits_of(exact, ids)
    steps = slice(len(spec["prompt"]) - 1, len(ids) - 1)
    chosen = exact_logits[steps].gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return {
        "tokens": tokens,
        "whole_tokens": whole_tokens,
        "split_error": float((split_logits - exact_logits).abs().mean()),
        "whole_error": float((whole_logits - exact_logits).abs().mean()),
        "logit_scale": float(exact_logits.abs().max()),
        "argmax_shortfall": (exact_logits[steps].max(dim=1).values - chosen).tolist(),
    }


@torch.no_grad()
def run_fused(spec: dict) -> list[object]:
    """The whole model's one-token step (its own code, eager) and the split one compiled (Dynamo, eager backend)
    through :class:`gpt_fast.parallel.tensor_parallel.ParallelRow`, each rank's GEMVs in Triton's interpreter."""
    from gpt_fast.accel.linear import register_triton_ops, use_linear_kernel
    from gpt_fast.model.config import ModelConfig
    from gpt_fast.model.transformer import Transformer
    from gpt_fast.parallel.tensor_parallel import join
    from tests.interpreted import patch_once_per_launch
    from tests.interpreter import gemv_calls

    patch_once_per_launch()
    config = ModelConfig(**spec["fused"])
    torch.manual_seed(0)
    whole = Transformer(config)
    whole.setup_caches(1, 32)
    x, pos = torch.tensor([[spec["prompt"][0]]]), torch.tensor([3])
    expected = whole(x, pos)  # [1, 1, V]
    parallel = join(spec["tp"], torch.device("cpu"))
    shard = parallel.shard
    split = Transformer(shard.local_config(config))
    shard.prepare(split, config, None)
    split.load_state_dict(shard.slice_state(whole.state_dict(), config))
    register_triton_ops()
    use_linear_kernel(split, "triton")
    parallel.connect(split, config)
    split.setup_caches(1, 32)
    calls = gemv_calls()
    got = torch.compile(split, backend="eager", fullgraph=True)(x, pos)
    return parallel.gather({"error": float((got - expected).abs().max()), "calls": calls})


def gloo_threads() -> list[str]:
    """The names of this process's threads that gloo started (Linux names its threads in /proc)."""
    names = (Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir())
    return [name for name in names if "gloo" in name]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = run_shape(spec) if "shape" in spec else run_fused(spec) if "fused" in spec else run_checkpoints(spec)
    if int(os.environ["RANK"]) == 0:
        Path(spec["out"]).write_text(json.dumps(result))
    leave()
    if threads := gloo_threads():
        raise RuntimeError(f"gloo's threads {threads} outlived leave(): something still holds the process group")


if __name__ == "__main__":
    main()
