"""Decode speed against the peers, in one process and one run: identical random weights of a named shape, ours (one
compile mode) and — when transformers is importable — Hugging Face transformers with its static cache (which it
compiles by itself on a CUDA GPU) and eager. With ``--quantize int8,int4``, the same weights quantized: ours in each
scheme, upstream gpt-fast's int8 formula (``F.linear(x, w.to(x.dtype)) * scales``, compiled by inductor: our
``dequant`` kernel) and, where torchao is importable, torchao's weight-only int8 and int4 (tinygemm layout) on our
model. On the CPU with ``--shape smollm2-135m``, the default model's shape, also llama.cpp on that model's GGUF
(Q4_1, and requantized by llama.cpp to Q8_0 and F16) when ``llama-cpp-python`` is importable
(:mod:`gpt_fast.bench.llama_cpp_peer`), on as many threads as ours. Every row samples top-k 200 at temperature 0.8
(the blog's setting), or greedily with ``--greedy``. Prints one table: tok/s, its ratio to our unquantized row, GB/s
(of the weights each row reads), % of the copy bandwidth measured in the same run, TTFT, compile time, memory; and
which kernels our decode steps used (``--attention_kernels triton,torch``, ``--activation_kernels triton,torch``,
``--layers_kernels triton,torch``, ``--linear_kernels triton,torch``: a row for each combination). ``--builds N``
builds (and compiles) each row N times: two builds of one configuration differ more than the timed runs of one
build, so tok/s is then the builds' median, their range beside it.

    gpt-fast bench decode --shape llama-2-7b --device cuda --quantize int8,int4
    OMP_NUM_THREADS=1 gpt-fast bench decode --device cpu --shape smollm2-135m --dtype float32 --mode default --greedy
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib.util
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gpt_fast.accel.choice import Context
from gpt_fast.accel.options import KernelOptions
from gpt_fast.accel.registry import resolve_one
from gpt_fast.bench.llama_cpp_peer import llama_cpp_builders
from gpt_fast.bench.modes import copy_bandwidth_gbps
from gpt_fast.bench.options import DecodeBenchOptions
from gpt_fast.convert.default_model import INT4_FORM
from gpt_fast.convert.hf_config import hf_config_dict
from gpt_fast.convert.layout import MODULE_NAMING, split_tensors
from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.kernels.available import triton_usable
from gpt_fast.model.config import ModelConfig, QuantConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.quant.layers import QuantizedLinear
from gpt_fast.quant.layout import quantize_state, stored_size
from gpt_fast.util.choices import COORDINATE_DESCENT, HEURISTIC
from gpt_fast.util.device import device_name, device_synchronize, dtype_name, parse_dtype, resolve_device
from gpt_fast.util.settings import apply_torch_settings

BLOG_SAMPLING = SamplingConfig(temperature=0.8, top_k=200)
GREEDY = SamplingConfig(temperature=0)


@dataclass(frozen=True)
class Row:
    name: str
    compile_seconds: float | None  # the first (warm-up) run's wall time
    tokens_per_sec: float  # median of the timed runs
    ttft_ms: float  # a prompt of --ttft_prompt tokens, one new token
    memory_gb: float | None
    bytes_per_token: int | None = None  # weights read per decoded token (None: as the first row)
    build_range: tuple[float, float] | None = None  # the lowest and highest build's tok/s, with --builds > 1


def timed(run: Callable[[], None], device: torch.device) -> float:
    device_synchronize(device)
    start = time.perf_counter()
    run()
    device_synchronize(device)
    return time.perf_counter() - start


Run = Callable[[list[int], int], None]  # generate (prompt ids, new tokens)
Builder = Callable[[], tuple[tuple[Run, Run], int | None]]  # a row's decode and first-token runs, bytes per token


def measure_build(
    name: str,
    runs: tuple[tuple[Run, Run], int | None],
    prompt: list[int],
    ttft_prompt: list[int],
    new_tokens: int,
    repeats: int,
    device: torch.device,
) -> Row:
    """A warm-up run (it compiles), ``repeats`` timed runs, then the time of a long prompt's first token (with
    the second of ``runs``: decode and first-token runs may be set up differently). ``runs`` come with the
    weight bytes a decode step reads, where known."""
    (run, ttft_run), bytes_per_token = runs
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first = timed(lambda: run(prompt, new_tokens), device)
    rates = [new_tokens / timed(lambda: run(prompt, new_tokens), device) for _ in range(repeats)]
    ttft_run(ttft_prompt, 1)  # compiles the long prompt's shapes, where they are compiled
    ttft = statistics.median(timed(lambda: ttft_run(ttft_prompt, 1), device) for _ in range(3))
    memory = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return Row(name, first, statistics.median(rates), 1e3 * ttft, memory, bytes_per_token)


def measure(
    name: str,
    build: Builder,
    prompt: list[int],
    ttft_prompt: list[int],
    new_tokens: int,
    repeats: int,
    device: torch.device,
    builds: int = 1,
) -> Row:
    """``builds`` times: build the row's runs anew (compiled again, from inductor's caches after the first) and
    :func:`measure_build` them. One build's timed runs agree within about 1 %, but on an H200 two builds of one
    configuration in one process can differ by 21 % (docs/bench/HISTORY.md, 2026-11-23i): with ``builds`` > 1 a row's
    tok/s and TTFT are the medians over its builds, and the builds' tok/s range is kept. The compile time and memory are
    the first build's."""
    rows = []
    for index in range(builds):
        if index:
            release_memory(device)
        rows.append(measure_build(name, build(), prompt, ttft_prompt, new_tokens, repeats, device))
    if builds == 1:
        return rows[0]
    rates = [row.tokens_per_sec for row in rows]
    return dataclasses.replace(
        rows[0],
        tokens_per_sec=statistics.median(rates),
        ttft_ms=statistics.median(row.ttft_ms for row in rows),
        build_range=(min(rates), max(rates)),
    )


@dataclass(frozen=True)
class Subject:
    """What every row of one run measures: the same weights (on the CPU), shape, compile mode, device and dtype,
    sampled alike."""

    state: dict[str, torch.Tensor]
    shape: ModelConfig
    mode: str
    device: torch.device
    dtype: torch.dtype
    regional_compile: bool = False  # our rows compile one layer and reuse it (EngineOptions.regional_compile)
    kernel_tuning: str = COORDINATE_DESCENT  # how inductor picks our kernels' configurations (EngineOptions)
    sampling: SamplingConfig = BLOG_SAMPLING


def ours_runners(
    subject: Subject,
    quant: QuantConfig | None = None,
    kernel: str = "auto",
    rework: Callable[[Engine], None] | None = None,
    attention: str = "auto",
    activation: str = "auto",
    layers: str = "auto",
    linear: str = "auto",
    sampling: str = "auto",
) -> tuple[tuple[Run, Run], int]:
    """Decode as ``gpt-fast generate --compile MODE`` does (eager prefill); the first token of the long prompt
    as with ``--compile_prefill`` (one compiled prefill for every prompt length, replayed from a CUDA graph in the
    CUDA-graph modes). The weights quantized with ``quant`` (their layers computing with ``kernel``), or changed by
    ``rework`` (torchao); the decode steps' attention computed by ``attention``, their layers by ``layers`` (see
    :mod:`gpt_fast.accel.persistent`), their unquantized linear layers by ``linear`` (see
    :mod:`gpt_fast.accel.linear`), their top-k sampling by ``sampling`` (see :mod:`gpt_fast.accel.top_k`);
    also the weight bytes a decode step reads."""
    mode, device, dtype = subject.mode, subject.device, subject.dtype
    options = EngineOptions(
        compile=mode,
        device=str(device),
        dtype=dtype_name(dtype),
        kernels=KernelOptions(kernel, attention, activation, layers, linear, sampling),
        regional_compile=subject.regional_compile,
        kernel_tuning=subject.kernel_tuning,
    )
    state = {name: t.to(device=device, dtype=dtype) for name, t in subject.state.items()}  # one copy, shared
    if quant is not None:
        state = quantize_state(state, subject.shape, quant, dtype, device)
    engines = [
        Engine.from_state(subject.shape, state, dataclasses.replace(options, compile_prefill=prefill), quant)
        for prefill in (False, mode != "none")
    ]
    bytes_per_token = engines[0].weight_bytes_per_token
    share_repacked_weights([engine.model for engine in engines])
    for engine in engines if rework is not None else ():
        rework(engine)

    def runner(engine: Engine) -> Run:
        def run(prompt: list[int], new_tokens: int) -> None:
            engine.generate_ids(prompt, new_tokens, subject.sampling)

        return run

    return (runner(engines[0]), runner(engines[1])), bytes_per_token


def share_repacked_weights(models: Sequence[torch.nn.Module]) -> None:
    """Give the quantized layers of every model after the first the first one's repacked weights. A row's engines
    (one decodes, one times the compiled prefill) are built from one shared state, but each quantized layer
    repacks its own copy for its kernel at load (``words``: int4, and int8 in 16-bit models, on a CUDA GPU), so
    the row would hold, and its memory column count, the weights twice where one engine holds them once."""
    first = dict(models[0].named_modules())
    for model in models[1:]:
        for name, module in model.named_modules():
            if isinstance(module, QuantizedLinear) and getattr(module, "words", None) is not None:
                module.words = first[name].words


def torchao_rework(scheme: QuantConfig) -> Callable[[Engine], None]:
    """Quantize an engine's layers with torchao as ``scheme`` does ours (the output projection left in float):
    int8 per channel; int4 in groups, in tinygemm's layout (PyTorch's ``_weight_int4pack_mm``). torchao's own
    inductor settings are not applied, so every row compiles with the same ones."""
    from torch import nn
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    if scheme.mode == "int8":
        config = Int8WeightOnlyConfig(set_inductor_config=False)
    else:
        config = Int4WeightOnlyConfig(
            group_size=scheme.group_size, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
        )

    def rework(engine: Engine) -> None:
        quantize_(engine.model, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn != "output")

    return rework


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
    state: dict[str, torch.Tensor],
    shape: ModelConfig,
    static: bool,
    device: torch.device,
    dtype: torch.dtype,
    sampling: SamplingConfig = BLOG_SAMPLING,
) -> tuple[Run, Run]:
    """transformers' ``generate`` with its static cache or its default (dynamic) one; ``sampling``'s top-k and
    temperature, or greedy."""
    model = hf_model({name: t.to(device=device, dtype=dtype) for name, t in state.items()}, shape, device)
    model.eval()
    extra = {"cache_implementation": "static"} if static else {}
    if sampling.greedy:
        extra |= {"do_sample": False}
    else:
        extra |= {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k}

    @torch.no_grad()
    def run(prompt: list[int], new_tokens: int) -> None:
        ids = torch.tensor([prompt], device=device)
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            **extra,
        )

    return run, run


def table(rows: list[Row], copy_gbps: float) -> str:
    """One line per row; the ratio is to the first row's tok/s, GB/s of the weights each row reads."""
    lines = [
        "| implementation | compile (s) | tok/s | × first | weights read (GB) | GB/s | % of copy BW | TTFT (ms) | "
        "memory (GB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bytes_per_token = r.bytes_per_token or rows[0].bytes_per_token
        gbps = bytes_per_token * r.tokens_per_sec / 1e9
        compile_s = "—" if r.compile_seconds is None else f"{r.compile_seconds:.1f}"
        rate = f"{r.tokens_per_sec:.1f}" + ("" if r.build_range is None else " ({:.1f}–{:.1f})".format(*r.build_range))
        memory = "—" if r.memory_gb is None else f"{r.memory_gb:.2f}"
        lines.append(
            f"| {r.name} | {compile_s} | {rate} | {r.tokens_per_sec / rows[0].tokens_per_sec:.2f} | "
            f"{bytes_per_token / 1e9:.3f} | {gbps:.0f} | {100 * gbps / copy_gbps:.1f} | {r.ttft_ms:.1f} | {memory} |"
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
    builds: int = 1,
    quantize: Sequence[QuantConfig] = (),
    quant_kernels: Sequence[str] = ("auto",),
    attention_kernels: Sequence[str] = ("auto",),
    activation_kernels: Sequence[str] = ("auto",),
    layers_kernels: Sequence[str] = ("auto",),
    linear_kernels: Sequence[str] = ("auto",),
    sampling_kernels: Sequence[str] = ("auto",),
    regional_compile: bool = False,
    kernel_tuning: str = COORDINATE_DESCENT,
    greedy: bool = False,
    write: Callable[[str], None] = print,
) -> list[Row]:
    shape = get_shape(shape_name)
    draws = GREEDY if greedy else BLOG_SAMPLING  # how every row samples
    context = Context(device, mode, shape, regional_compile=regional_compile, dtype=dtype)

    def resolved(name: str, choices: Sequence[str]) -> list[str]:
        return list(dict.fromkeys(resolve_one(name, choice, context) for choice in choices))

    attention = resolved("attention", attention_kernels)
    activation = resolved("activation", activation_kernels)
    layers = resolved("layers", layers_kernels)
    linear = resolved("linear", linear_kernels)
    sampling = resolved("sampling", sampling_kernels)
    state = random_weights(shape, dtype, seed=0, device=device)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, shape.vocab_size, (prompt_tokens,), generator=generator).tolist()
    ttft_prompt = torch.randint(0, shape.vocab_size, (ttft_tokens,), generator=generator).tolist()
    copy_gbps = copy_bandwidth_gbps(device)
    write(f"measured: copy bandwidth {copy_gbps:.0f} GB/s")  # now, so that a run cut off later still has it
    subject = Subject(state, shape, mode, device, dtype, regional_compile, kernel_tuning, draws)
    suffix, compiled_as = describe_compilation(regional_compile, kernel_tuning)
    ours = f"gpt-fast {mode}{suffix}"
    runners: dict[str, Builder] = {
        ours
        + (f" attention-{att}" if len(attention) > 1 else "")
        + (f" activation-{act}" if len(activation) > 1 else "")
        + (f" layers-{lay}" if len(layers) > 1 else "")
        + (f" linear-{lin}" if len(linear) > 1 else "")
        + (f" sampling-{smp}" if len(sampling) > 1 else ""): functools.partial(
            ours_runners, subject, attention=att, activation=act, layers=lay, linear=lin, sampling=smp
        )
        for att in attention
        for act in activation
        for lay in layers
        for lin in linear
        for smp in sampling
    }
    runners |= quantized_runners(subject, quantize, write, linear, quant_kernels)
    if peers:
        runners |= transformers_runners(state, shape, device, dtype, draws, write)
        context_tokens = max(prompt_tokens + new_tokens, ttft_tokens + 1)
        runners |= llama_cpp_builders(shape_name, shape, device, context_tokens, draws, write)
    rows = []
    for name, build in runners.items():  # each built when measured and freed after
        try:
            rows.append(measure(name, build, prompt, ttft_prompt, new_tokens, repeats, device, builds))
            write(f"measured: {rows[-1]}")
        except torch.OutOfMemoryError as error:  # a peer that needs more memory than ours loses its row only
            write(f"not measured: {name}: out of memory ({str(error).splitlines()[0]})")
        release_memory(device)
    threads = f", CPU threads: {torch.get_num_threads()}" if device.type == "cpu" else ""
    write(
        f"{shape_name}, {device_name(device)}{threads}, torch {torch.__version__}, {dtype}; copy bandwidth "
        f"{copy_gbps:.0f} GB/s; prompt {prompt_tokens} tokens, {new_tokens} new, TTFT prompt {ttft_tokens}, "
        f"{describe_sampling(draws)}; our decode's attention kernel: {', '.join(attention)}; activation kernel: "
        f"{', '.join(activation)}; layers kernel: {', '.join(layers)}; linear kernel: {', '.join(linear)}; sampling "
        f"kernel: {', '.join(sampling)}; our compiled steps: {compiled_as}"
        + (f"; each row built {builds} times, tok/s their median (range)" if builds > 1 else "")
    )
    write(table(rows, copy_gbps) if rows else "no row was measured")
    return rows


def transformers_runners(
    state: dict[str, torch.Tensor],
    shape: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    sampling: SamplingConfig,
    write: Callable[[str], None],
) -> dict[str, Builder]:
    """transformers' rows, where it is importable: its static cache (which its ``generate`` compiles by itself on a
    CUDA GPU, not on a CPU) and its default cache, eager."""
    try:
        import transformers
    except ImportError:
        write("transformers is not importable: its rows skipped")
        return {}
    name = f"transformers {transformers.__version__}"
    compiled = " + compile" if device.type == "cuda" else ""
    return {
        f"{name} static cache{compiled}": lambda: (hf_runners(state, shape, True, device, dtype, sampling), None),
        f"{name} eager": lambda: (hf_runners(state, shape, False, device, dtype, sampling), None),
    }


def describe_sampling(sampling: SamplingConfig) -> str:
    """The summary line's words for how every row samples."""
    return "greedy" if sampling.greedy else f"sampled: top-k {sampling.top_k} at temperature {sampling.temperature}"


def describe_compilation(regional_compile: bool, kernel_tuning: str) -> tuple[str, str]:
    """Our rows' name suffix and the summary line's words for how their steps are compiled."""
    suffix = (" regional" if regional_compile else "") + (" heuristic" if kernel_tuning == HEURISTIC else "")
    steps = "one layer compiled and reused (regional)" if regional_compile else "the whole step compiled"
    kernels = "as inductor picks them" if kernel_tuning == HEURISTIC else "tuned by coordinate descent"
    return suffix, f"{steps}, kernels {kernels}"


def release_memory(device: torch.device) -> None:
    """Free what the last row held: its compiled graphs (and their CUDA-graph memory pools), then the objects
    that refer to each other (transformers' models hold their compiled forward, which holds the model), then the
    allocator's cached blocks."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def quantized_runners(
    subject: Subject,
    schemes: Sequence[QuantConfig],
    write: Callable[[str], None],
    linear: Sequence[str] = ("auto",),
    kernels: Sequence[str] = ("auto",),
) -> dict[str, Builder]:
    """The rows of ``--quantize``: ours per scheme (int4 on a CUDA GPU: with our Triton kernel, the automatic
    choice, and with PyTorch's tinygemm), upstream's int8, torchao's where importable. Ours once per quantized
    ``kernels`` and ``linear`` kernel where there are several (``triton`` launches our quantized kernels with PDL
    in CUDA-graph steps)."""
    runners: dict[str, Builder] = {}
    torchao = importlib.util.find_spec("torchao") is not None
    if schemes and not torchao:
        write("torchao is not importable: its rows skipped")
    for scheme in schemes:
        for kernel, lin in itertools.product(kernels, linear):
            name = f"gpt-fast {subject.mode} {scheme.name}" + (f" {kernel}" if len(kernels) > 1 else "")
            name += f" linear-{lin}" if len(linear) > 1 else ""
            runners[name] = functools.partial(ours_runners, subject, scheme, kernel, linear=lin)
        if scheme.mode == "int4" and triton_usable(subject.device):
            runners[f"gpt-fast {subject.mode} {scheme.name} tinygemm"] = functools.partial(
                ours_runners, subject, scheme, "aten"
            )
        if scheme.mode == "int8":
            runners[f"upstream-style {scheme.name} (dequant + F.linear, inductor)"] = functools.partial(
                ours_runners, subject, scheme, "dequant"
            )
        if torchao:
            from importlib.metadata import version

            runners[f"torchao {version('torchao')} {scheme.name}"] = functools.partial(torchao_runs, subject, scheme)
    return runners


def torchao_runs(subject: Subject, scheme: QuantConfig) -> tuple[tuple[Run, Run], int | None]:
    """torchao's layers on our model; the bytes they read are taken to be ours for the same scheme. Its linear layers
    stay ``torch``'s (``F.linear``, which torchao's weights dispatch): ours would hand its weights to our kernels."""
    runs, _ = ours_runners(subject, rework=torchao_rework(scheme), linear="torch")
    return runs, scheme_bytes_per_token(subject.shape, scheme, subject.dtype)


def scheme_bytes_per_token(shape: ModelConfig, scheme: QuantConfig, dtype: torch.dtype) -> int:
    """The weight bytes a decode step of ``shape`` quantized with ``scheme`` reads, counted as
    :func:`gpt_fast.model.transformer.weight_bytes_per_token` counts them: all but an embedding table that is not the
    output projection."""
    stored = stored_size(shape, scheme, dtype)[1]
    table_is_output = shape.tie_embeddings and not scheme.output
    return stored if table_is_output else stored - shape.vocab_size * shape.dim * dtype.itemsize


TABLE_QUANT = INT4_FORM.embeddings  # the default model's table in its CPU form: its GGUF's Q8_0 blocks


def quant_schemes(names: Sequence[str], group_size: int, table: bool = False) -> list[QuantConfig]:
    """``("int8", "int4")`` -> the schemes (int4 in groups of ``group_size``; ``table``: a tied embedding table
    quantized in place, :data:`TABLE_QUANT`)."""
    embeddings = TABLE_QUANT if table else None
    return [QuantConfig(name, group_size if name == "int4" else None, embeddings=embeddings) for name in names]


def run(options: DecodeBenchOptions, write: Callable[[str], None] = print) -> list[Row]:
    """The benchmark of ``options`` (`gpt-fast bench decode`): one table, written with ``write``."""
    apply_torch_settings()
    return run_benchmark(
        options.shape,
        resolve_device(options.device),
        mode=options.mode,
        dtype=parse_dtype(options.dtype),
        prompt_tokens=options.prompt_tokens,
        new_tokens=options.new_tokens,
        ttft_tokens=options.ttft_tokens,
        repeats=options.repeats,
        builds=options.builds,
        peers=options.peers,
        quantize=quant_schemes(options.quantize, options.group_size, options.quantize_table),
        quant_kernels=options.quant_kernels,
        attention_kernels=options.attention_kernels,
        activation_kernels=options.activation_kernels,
        layers_kernels=options.layers_kernels,
        linear_kernels=options.linear_kernels,
        sampling_kernels=options.sampling_kernels,
        regional_compile=options.regional_compile,
        kernel_tuning=options.kernel_tuning or COORDINATE_DESCENT,
        greedy=options.greedy,
        write=write,
    )


if __name__ == "__main__":  # python -m gpt_fast.bench.decode: `gpt-fast bench decode`
    from gpt_fast.cli.bench import run_alias

    run_alias("decode")
