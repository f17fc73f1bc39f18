"""Decode speed against the peers, in one process and one run: identical random weights of a named shape, ours
(one compile mode) and — when transformers is importable — Hugging Face transformers with its static cache (which
it compiles by itself) and eager. Prints one table: tok/s, GB/s, % of the copy bandwidth measured in the same run,
TTFT, compile time, memory.

    python -m gpt_fast.bench_decode --shape llama-2-7b --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpt_fast.bench import copy_bandwidth_gbps
from gpt_fast.config import ModelConfig
from gpt_fast.convert.hf_config import hf_config_dict
from gpt_fast.convert.layout import MODULE_NAMING, split_tensors
from gpt_fast.convert.random_init import random_weights
from gpt_fast.device import device_name, device_synchronize, dtype_name, parse_dtype
from gpt_fast.engine import Engine, EngineOptions
from gpt_fast.sampling import SamplingConfig
from gpt_fast.settings import apply_torch_settings
from gpt_fast.shapes import SHAPES, get_shape

BLOG_SAMPLING = SamplingConfig(temperature=0.8, top_k=200)


@dataclass(frozen=True)
class Row:
    name: str
    compile_seconds: float | None  # the first (warm-up) run's wall time
    tokens_per_sec: float  # median of the timed runs
    ttft_ms: float  # a prompt of --ttft_prompt tokens, one new token
    memory_gb: float | None


def timed(run: Callable[[], None], device: torch.device) -> float:
    device_synchronize(device)
    start = time.perf_counter()
    run()
    device_synchronize(device)
    return time.perf_counter() - start


Run = Callable[[list[int], int], None]  # generate (prompt ids, new tokens)


def measure(
    name: str,
    runs: tuple[Run, Run],
    prompt: list[int],
    ttft_prompt: list[int],
    new_tokens: int,
    repeats: int,
    device: torch.device,
) -> Row:
    """A warm-up run (it compiles), ``repeats`` timed runs, then the time of a long prompt's first token (with
    the second of ``runs``: decode and first-token runs may be set up differently)."""
    run, ttft_run = runs
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first = timed(lambda: run(prompt, new_tokens), device)
    rates = [new_tokens / timed(lambda: run(prompt, new_tokens), device) for _ in range(repeats)]
    ttft_run(ttft_prompt, 1)  # compiles the long prompt's shapes, where they are compiled
    ttft = statistics.median(timed(lambda: ttft_run(ttft_prompt, 1), device) for _ in range(3))
    memory = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return Row(name, first, statistics.median(rates), 1e3 * ttft, memory)


def ours_runners(
    state: dict[str, torch.Tensor], shape: ModelConfig, mode: str, device: torch.device, dtype: torch.dtype
) -> tuple[tuple[Run, Run], int]:
    """Decode as ``gpt-fast generate --compile MODE`` does (eager prefill); the first token of the long prompt
    as with ``--compile_prefill`` (one compiled prefill for every prompt length). Also the weight bytes a decode
    step reads."""
    options = EngineOptions(compile=mode, device=str(device), dtype=dtype_name(dtype))
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}  # one copy, both engines share it
    decode_engine = Engine.from_state(shape, state, options)
    ttft_engine = Engine.from_state(shape, state, dataclasses.replace(options, compile_prefill=mode != "none"))

    def runner(engine: Engine) -> Run:
        def run(prompt: list[int], new_tokens: int) -> None:
            engine.generate_ids(prompt, new_tokens, BLOG_SAMPLING)

        return run

    return (runner(decode_engine), runner(ttft_engine)), decode_engine.weight_bytes_per_token


def hf_model(state: dict[str, torch.Tensor], shape: ModelConfig, device: torch.device) -> torch.nn.Module:
    """transformers' model of ``shape``'s family holding ``state``'s tensors themselves (no second copy: a
    Mixtral-8x7B fits the GPU once, not twice). Built on the meta device; its buffers (rotary tables, Gemma's
    embedding scale) are then made on ``device`` as transformers makes them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = hf_config_dict(shape)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(split_tensors(state, shape, MODULE_NAMING), strict=not shape.tie_embeddings, assign=True)
    if shape.tie_embeddings:
        model.tie_weights()
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if hasattr(module, "scalar_embed_scale"):
            module.register_buffer("embed_scale", torch.tensor(module.scalar_embed_scale, device=device), False)
        else:  # a rotary embedding
            with torch.device(device):
                model.set_submodule(name, type(module)(model.config))
    return model


def hf_runners(
    state: dict[str, torch.Tensor], shape: ModelConfig, static: bool, device: torch.device, dtype: torch.dtype
) -> tuple[Run, Run]:
    model = hf_model({name: t.to(device=device, dtype=dtype) for name, t in state.items()}, shape, device)
    model.eval()
    extra = {"cache_implementation": "static"} if static else {}

    @torch.no_grad()
    def run(prompt: list[int], new_tokens: int) -> None:
        ids = torch.tensor([prompt], device=device)
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            temperature=BLOG_SAMPLING.temperature,
            top_k=BLOG_SAMPLING.top_k,
            pad_token_id=0,
            **extra,
        )

    return run, run


def table(rows: list[Row], bytes_per_token: int, copy_gbps: float) -> str:
    lines = [
        "| implementation | compile (s) | tok/s | GB/s | % of copy BW | TTFT (ms) | memory (GB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gbps = bytes_per_token * r.tokens_per_sec / 1e9
        compile_s = "—" if r.compile_seconds is None else f"{r.compile_seconds:.1f}"
        memory = "—" if r.memory_gb is None else f"{r.memory_gb:.2f}"
        lines.append(
            f"| {r.name} | {compile_s} | {r.tokens_per_sec:.1f} | {gbps:.0f} | {100 * gbps / copy_gbps:.1f} | "
            f"{r.ttft_ms:.1f} | {memory} |"
        )
    return "\n".join(lines)


def run_benchmark(
    shape_name: str,
    device: torch.device,
    *,
    mode: str,
    dtype: torch.dtype,
    prompt_tokens: int,
    new_tokens: int,
    ttft_tokens: int,
    repeats: int,
    peers: bool,
    write: Callable[[str], None] = print,
) -> list[Row]:
    shape = get_shape(shape_name)
    state = random_weights(shape, dtype, seed=0, device=device)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, shape.vocab_size, (prompt_tokens,), generator=generator).tolist()
    ttft_prompt = torch.randint(0, shape.vocab_size, (ttft_tokens,), generator=generator).tolist()
    copy_gbps = copy_bandwidth_gbps(device)
    facts: dict[str, int] = {}

    def build_ours() -> tuple[Run, Run]:  # built when measured, freed after, like the peers
        runs, facts["bytes_per_token"] = ours_runners(state, shape, mode, device, dtype)
        return runs

    runners = {f"gpt-fast {mode}": build_ours}
    if peers:
        try:
            import transformers
        except ImportError:
            write("transformers is not importable: peers skipped")
        else:
            runners[f"transformers {transformers.__version__} static cache + compile"] = lambda: hf_runners(
                state, shape, True, device, dtype
            )
            runners[f"transformers {transformers.__version__} eager"] = lambda: hf_runners(
                state, shape, False, device, dtype
            )
    rows = []
    for name, build in runners.items():
        rows.append(measure(name, build(), prompt, ttft_prompt, new_tokens, repeats, device))
        write(f"measured: {rows[-1]}")
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bytes_per_token = facts["bytes_per_token"]
    write(
        f"{shape_name}, {device_name(device)}, torch {torch.__version__}, {dtype}; copy bandwidth {copy_gbps:.0f} "
        "GB/s; "
        f"weights read per token {bytes_per_token / 1e9:.3f} GB; prompt {prompt_tokens} tokens, {new_tokens} new, "
        f"TTFT prompt {ttft_tokens}"
    )
    write(table(rows, bytes_per_token, copy_gbps))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Decode speed of gpt-fast and its peers on identical random weights.")
    parser.add_argument("--shape", default="llama-2-7b", choices=list(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mode", default="reduce-overhead")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt_tokens", type=int, default=5)
    parser.add_argument("--new_tokens", type=int, default=200)
    parser.add_argument("--ttft_tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no_peers", action="store_true")
    args = parser.parse_args(argv)
    apply_torch_settings()
    run_benchmark(
        args.shape,
        torch.device(args.device),
        mode=args.mode,
        dtype=parse_dtype(args.dtype),
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        ttft_tokens=args.ttft_tokens,
        repeats=args.repeats,
        peers=not args.no_peers,
    )


if __name__ == "__main__":
    main()
