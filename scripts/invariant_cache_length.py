"""Does a batch-invariant step's result depend on the KV cache's length? It must not: a request's cache is as long as
its prompt and token count ask (rounded up), so a token would otherwise depend on how many tokens were asked for, and a
replay recorded with a longer cache would not replay (docs/bench/HISTORY.md, 2026-11-23g and 2026-11-23h: on an H200, an
attention that combines its splits in an order that depends on the cache's length makes the Llama-2-7B shape's plain
decoding of 200 tokens and of 230 part ways; with the attention's fixed order this script finds every run alike).

Random weights of a shape, ``--batch_invariant``, greedy:

1. for ``none``, ``reduce-overhead``, and ``reduce-overhead`` with Dynamo's automatic dynamic shapes off (so a second
   cache length compiles a second static graph rather than one with a symbolic length): plain decoding of 200 tokens
   twice, of 230 (a longer cache), of 200 again; whether they agree, and where 230 parts from 200;
2. eager, the same tokens forced through caches of 256 and 320 positions: the first step (0 = the prompt's prefill)
   whose logits differ, the first layer whose output differs at that step, and which layers' cached keys differ.

    python scripts/invariant_cache_length.py [--shape llama-2-7b] [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch

from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.model.shapes import SHAPES, get_shape
from gpt_fast.model.transformer import Transformer
from gpt_fast.util.settings import apply_torch_settings

GREEDY = SamplingConfig(temperature=0)
PROMPT_TOKENS, FORCED_STEPS, LENGTHS = 32, 28, (256, 320)


def alike(x: object, y: object) -> bool:
    return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def first_difference(a: list, b: list) -> int | None:
    """The first index where ``a`` and ``b`` (tokens or tensors) differ; None if they agree as far as both go."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if not alike(x, y)), None)


def plain_runs(engine: Engine, prompt: list[int]) -> str:
    def run(n: int) -> list[int]:
        return engine.generate_ids(prompt, n, GREEDY, ignore_eos=True).tokens[0]

    a, b, c, d = run(200), run(200), run(230), run(200)
    return f"200 twice alike {a == b}; 200 after 230 alike {a == d}; 230 parts from 200 at {first_difference(a, c)}"


def forced(model: Transformer, tokens: torch.Tensor, length: int) -> tuple[list, list, list]:
    """Logits of the prefill and of each forced step, every layer's output, every layer's cached keys and values."""
    model.setup_caches(1, length)
    outputs: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outputs.append(o.detach().clone())) for layer in model.layers]
    device = tokens.device
    with torch.no_grad():
        logits = [
            model(
                tokens[:, :PROMPT_TOKENS], torch.arange(PROMPT_TOKENS, device=device), last_only=True, from_start=True
            )
        ]
        for p in range(PROMPT_TOKENS, PROMPT_TOKENS + FORCED_STEPS):
            logits.append(model(tokens[:, p : p + 1], torch.tensor([p], device=device)))
    for hook in hooks:
        hook.remove()
    end = PROMPT_TOKENS + FORCED_STEPS
    return logits, outputs, [layer.attention.kv_cache.kv[:, :, :, :end].clone() for layer in model.layers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-2-7b", choices=list(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    apply_torch_settings()
    config = get_shape(args.shape)
    prompt = torch.randint(0, config.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    weights = random_weights(config, torch.bfloat16, seed=0, device=args.device)
    start = time.time()
    eager = None
    for mode, automatic_dynamic in (("none", True), ("reduce-overhead", True), ("reduce-overhead", False)):
        torch._dynamo.reset()  # each variant compiles afresh
        options = EngineOptions(compile=mode, device=args.device, dtype="bfloat16", batch_invariant=True)
        engine = Engine.from_state(config, weights, options)
        with torch._dynamo.config.patch(automatic_dynamic_shapes=automatic_dynamic):
            runs = plain_runs(engine, prompt)
        shapes = "" if mode == "none" else f", automatic dynamic shapes {'on' if automatic_dynamic else 'off'}"
        print(f"[{time.time() - start:.0f} s] {mode}{shapes}: {runs}", flush=True)
        eager = eager or engine
    decoded = eager.generate_ids(prompt, FORCED_STEPS, GREEDY, ignore_eos=True).tokens[0]
    tokens = torch.tensor([prompt + decoded], device=args.device)
    (logits_a, outputs_a, kv_a), (logits_b, outputs_b, kv_b) = (forced(eager.model, tokens, n) for n in LENGTHS)
    step = first_difference(logits_a, logits_b)
    print(f"caches of {LENGTHS[0]} and {LENGTHS[1]} positions, forced tokens: first step whose logits differ: {step}")
    if step is not None:
        n = config.n_layer
        layer = first_difference(outputs_a[step * n : (step + 1) * n], outputs_b[step * n : (step + 1) * n])
        print(f"  first layer whose output differs at that step: {layer}")
        differ = [i for i, (x, y) in enumerate(zip(kv_a, kv_b, strict=True)) if not torch.equal(x, y)]
        print(f"  layers whose cached keys and values differ: {differ}")
    print(f"[{time.time() - start:.0f} s] done", flush=True)


if __name__ == "__main__":
    main()
