"""The `gpt-fast` command. User mistakes end as one line on stderr and a non-zero exit status, before any weights
are read; every command sits on the engine API (:mod:`gpt_fast.engine.engine`).

This module imports no torch: ``--help`` and argument errors answer at once, and each command imports what it runs
(the choices and defaults of the options come from :mod:`gpt_fast.util.choices`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from gpt_fast import __version__
from gpt_fast.accel.options import KERNEL_CHOICES, LAYERS_KERNELS, LINEAR_KERNELS, SAMPLING_KERNELS, KernelOptions
from gpt_fast.cli.bench import bench, comma_list
from gpt_fast.model.config import INT4_GROUP_SIZES, QUANT_KERNELS, QUANT_MODES, QuantConfig
from gpt_fast.model.shapes import SHAPES, get_shape
from gpt_fast.util.choices import (
    CALIBRATION_TEXT,
    CALIBRATION_TOKENS,
    COMPILE_MODES,
    COORDINATE_DESCENT,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NUM_SAMPLES,
    DEFAULT_PROMPT,
    DEFAULT_SPECULATE_K,
    DTYPE_CHOICES,
    DTYPE_NAMES,
    EVAL_DATASETS,
    EVAL_MAX_TOKENS,
    EVAL_WINDOW,
    KERNEL_TUNINGS,
    KV_CACHES,
    KV_DTYPE_CHOICES,
)
from gpt_fast.util.fileio import STDOUT, regular_file
from gpt_fast.util.openmp import prefer_passive_waits
from gpt_fast.util.options import OptionError

if TYPE_CHECKING:
    from gpt_fast.engine.engine import Engine
    from gpt_fast.engine.options import EngineOptions
    from gpt_fast.generation.options import OutputConstraint

EXIT_USER_ERROR = 1
EXIT_INTERRUPTED = 130
# int4 with the default GPTQ recipe, default model, eval text: groups of 64 +4.8 % over float, groups of 128 +8.6 %
# (docs/bench/2026-11-28_quant_int4_default_cpu.txt)
DEFAULT_GROUP_SIZE = 64
CALIBRATE_METHODS = ("gptq", "none")
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class Choice(click.Choice):
    """A choice that ``--help`` lists, whose error reads like all of ours: ``--compile 'x' is not one of …``."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value in self.choices:
            return value
        name = param.opts[0] if param is not None else "value"
        raise ValueError(f"{name} {value!r} is not one of {', '.join(map(str, self.choices))}")


def option(*names: str, **kwargs: Any) -> Decorator:
    """A click option that also answers to the dashed spelling of an underscored name (--max_new_tokens,
    --max-new-tokens); in an on/off pair (--act_order/--no_act_order), each side that has an underscore."""
    spellings = list(names)
    for name in names:
        if name.startswith("--") and "_" in name:
            sides = [side.replace("_", "-") if "_" in side else "" for side in name.split("/")]
            spellings.append(" " * (not sides[0]) + "/".join(sides))  # " /--off": click splits a leading "/" on ";"
    return click.option(*spellings, **kwargs)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.version_option(__version__, "--version", prog_name="gpt-fast", message="%(prog)s %(version)s")
def cli() -> None:
    """Fast LLM text generation in native PyTorch.

    On the CPU, torch runs one thread per core this process may use (its CPU affinity, capped by its cgroup's CPU
    quota), said on a run's first line; set OMP_NUM_THREADS to choose another count."""


def checkpoint_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return option(
        "--checkpoint_path",
        default=None,
        help="A converted checkpoint's model.pth or folder, or ORG/NAME prepared in checkpoints/. "
        "Default: the embedded SmolLM2-135M-Instruct.",
    )(func)


def sampling_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--temperature, --top_k, --top_p, handed to the command as ``sampling``: the values given, by name (checked
    here, before any file is read); the others come from the checkpoint (:meth:`Engine.sampling_choice`)."""

    @functools.wraps(func)
    def command(*args: Any, temperature: float | None, top_k: int | None, top_p: float | None, **kwargs: Any) -> Any:
        from gpt_fast.generation.options import SamplingConfig

        given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        given = {name: value for name, value in given.items() if value is not None}
        SamplingConfig(**given)
        return func(*args, sampling=given, **kwargs)

    recommended = "[default: the checkpoint's recommended value (its generation_config.json), else {}]"
    decorated = option(
        "--top_p",
        type=float,
        default=None,
        help=f"Nucleus sampling: keep the smallest set of tokens reaching this probability. {recommended.format(1.0)}",
    )(command)
    decorated = option(
        "--top_k", type=int, default=None, help=f"Sample among the k most likely tokens. {recommended.format(200)}"
    )(decorated)
    return option("--temperature", type=float, default=None, help=f"0 = greedy. {recommended.format(0.8)}")(decorated)


def device_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--device, --dtype, --kv_cache_dtype, handed to the command as ``engine_options`` (a checked EngineOptions)."""

    @functools.wraps(func)
    def command(
        *args: Any, device: str | None, dtype: str, kv_cache_dtype: str, threads: int | None, **kwargs: Any
    ) -> Any:
        from gpt_fast.engine.options import EngineOptions

        options = EngineOptions(device=device, dtype=dtype, threads=threads, kv_cache_dtype=kv_cache_dtype)
        return func(*args, engine_options=options, **kwargs)

    return add_device_options(add_kv_dtype_option(command))


def add_kv_dtype_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--kv_cache_dtype``, ``auto`` by default."""
    return option(
        "--kv_cache_dtype",
        type=Choice(KV_DTYPE_CHOICES),
        default="auto",
        show_default=True,
        help="The KV cache's dtype; auto: the model's. float16 on the CPU reads half the bytes a step's attention "
        "reads in float32 (keys and values rounded to float16, as llama.cpp keeps them; docs/cpu.md). "
        "float8_e4m3fn holds twice a 16-bit cache's tokens in the same memory (GPUs; docs/serving.md).",
    )(func)


def add_device_options(func: Callable[..., Any]) -> Callable[..., Any]:
    func = option(
        "--threads",
        type=int,
        default=None,
        help="Torch's threads on the CPU. Default: OMP_NUM_THREADS, else one per core this process may use (its CPU "
        "affinity, capped by its cgroup's CPU quota).",
    )(func)
    func = option(
        "--dtype",
        type=Choice(DTYPE_CHOICES),
        default="auto",
        show_default=True,
        help="auto: bfloat16 on a GPU, float32 on the CPU.",
    )(func)
    return option("--device", default=None, metavar="[cpu|cuda|cuda:N]", help="Default: the GPU when present.")(func)


def kernel_option(name: str, choices: tuple[str, ...], help: str) -> Decorator:
    """``--NAME_kernel``, one of ``choices``, ``auto`` by default."""
    return option(f"--{name}_kernel", type=Choice(choices), default="auto", show_default=True, help=help)


def engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--compile, --compile_prefill, --regional_compile, --kernel_tuning, --layers_kernel, --linear_kernel,
    --sampling_kernel, --quant_kernel, --device, --dtype, --kv_cache_dtype, handed to the command as
    ``engine_options``."""

    @functools.wraps(func)
    def command(
        *args: Any,
        compile_mode: str,
        compile_prefill: bool,
        regional_compile: bool,
        kernel_tuning: str,
        layers_kernel: str,
        linear_kernel: str,
        sampling_kernel: str,
        quant_kernel: str,
        device: str | None,
        dtype: str,
        kv_cache_dtype: str,
        threads: int | None,
        **kwargs: Any,
    ) -> Any:
        from gpt_fast.engine.options import EngineOptions

        options = EngineOptions(
            compile_mode,
            compile_prefill,
            device,
            dtype,
            regional_compile=regional_compile,
            kernel_tuning=kernel_tuning,
            kernels=KernelOptions(
                quant=quant_kernel, layers=layers_kernel, linear=linear_kernel, sampling=sampling_kernel
            ),
            threads=threads,
            kv_cache_dtype=kv_cache_dtype,
        )
        return func(*args, engine_options=options, **kwargs)

    decorated = add_device_options(add_kv_dtype_option(command))
    decorated = kernel_option(
        "quant",
        QUANT_KERNELS,
        "A quantized checkpoint's products. triton: our Triton kernels (CUDA GPUs); gemlite: triton, with an "
        "int8 model's batched steps (4 to 64 rows) on gemlite's kernels (the gemlite extra; the weights twice in "
        "memory); cpp: our C++ kernels (x86 CPUs with AVX2); cpp-q8: cpp with activations rounded to int8 per 32 "
        "columns as llama.cpp does (faster, most with AVX512-VNNI; not the float model's numbers); aten: "
        "PyTorch's weight-only kernels; dequant: "
        "dequantize then F.linear; auto: triton on CUDA GPUs, cpp where it builds, else aten or dequant.",
    )(decorated)
    decorated = kernel_option(
        "sampling",
        SAMPLING_KERNELS,
        "triton: top-k sampling (16-bit logits, no top-p) in two Triton kernels instead of torch.topk (CUDA "
        "GPUs); torch: torch.topk; auto: triton where the linear kernel's auto is triton.",
    )(decorated)
    decorated = kernel_option(
        "linear",
        LINEAR_KERNELS,
        "triton: the decoder layers' unquantized linear layers in compiled one-token steps of one sequence are "
        "our GEMV, launched so that its weight loads overlap the kernel before it (CUDA GPUs); torch: cuBLAS or "
        "inductor's; auto: triton in the CUDA-graph modes on GPUs of compute capability 9+.",
    )(decorated)
    decorated = kernel_option(
        "layers",
        LAYERS_KERNELS,
        "triton: a compiled one-token decode step of one sequence runs every layer in one persistent kernel "
        "(small Llama-style models on CUDA GPUs; fewer launches, a compile without the layers); torch: inductor's "
        "kernels; auto: torch.",
    )(decorated)
    decorated = option(
        "--kernel_tuning",
        type=Choice(KERNEL_TUNINGS),
        default=COORDINATE_DESCENT,
        show_default=True,
        help="coordinate-descent: inductor benchmarks neighbouring block sizes of each generated kernel at its "
        "first run (faster kernels; most of a cold compile); heuristic: its first choice (compiles several times "
        "faster).",
    )(decorated)
    decorated = option(
        "--regional_compile",
        is_flag=True,
        help="Compile one transformer layer and reuse it for every layer: faster compilation; the decode speed "
        "may differ (no fusion across layers).",
    )(decorated)
    decorated = option(
        "--compile_prefill",
        is_flag=True,
        help="Also compile the prefill (dynamic shapes; replayed from CUDA graphs in the CUDA-graph modes).",
    )(decorated)
    return option(
        "--compile",
        "compile_mode",
        type=Choice(COMPILE_MODES),
        default="none",
        show_default=True,
        help="The torch.compile mode (none: eager).",
    )(decorated)


def read_prompts(prompts: tuple[str, ...], prompt_file: Path | None, prompts_file: Path | None) -> list[str]:
    """The prompts of `generate`: ``--prompt`` (repeated for several), ``--prompt_file`` or ``--prompts_file`` (one
    prompt per line, empty lines skipped)."""
    if prompts_file is not None:
        if prompts or prompt_file is not None:
            raise ValueError("give --prompts_file alone, without --prompt or --prompt_file")
        text = read_text_file(prompts_file, "--prompts_file")
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"--prompts_file {prompts_file} holds no prompt")
        return lines
    if len(prompts) > 1:
        if prompt_file is not None:
            raise ValueError("give --prompt or --prompt_file, not both")
        if STDOUT in prompts:
            raise ValueError("--prompt - reads one prompt from standard input, alone")
        return list(prompts)
    return [read_prompt(prompts[0] if prompts else None, prompt_file)]


def aot_precompile_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """--aot_precompile (one prompt's decode step: generate, chat), folded into the command's ``engine_options``
    (so it goes below the decorator that makes them)."""

    @functools.wraps(func)
    def command(*args: Any, aot_precompile: bool, engine_options: EngineOptions, **kwargs: Any) -> Any:
        options = dataclasses.replace(engine_options, aot_precompile=aot_precompile)
        return func(*args, engine_options=options, **kwargs)

    return option(
        "--aot_precompile",
        is_flag=True,
        help="Keep the compiled decode step on disk (torch's experimental ahead-of-time compile) and load it in the "
        "next run instead of tracing the model again: warm starts in seconds. One prompt; not with --tp, "
        "--regional_compile or speculation.",
    )(command)


def speculative_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--draft_checkpoint_path, --prompt_lookup, --speculate_k, --batch_invariant, folded into the command's
    ``engine_options`` (so it goes below the decorator that makes them)."""

    @functools.wraps(func)
    def command(
        *args: Any,
        draft_checkpoint_path: str | None,
        prompt_lookup: int | None,
        speculate_k: int | None,
        batch_invariant: bool,
        engine_options: EngineOptions,
        **kwargs: Any,
    ) -> Any:
        from gpt_fast.generation.options import SpeculativeOptions

        speculative = SpeculativeOptions.from_flags(draft_checkpoint_path, prompt_lookup, speculate_k)
        options = dataclasses.replace(engine_options, speculative=speculative, batch_invariant=batch_invariant)
        return func(*args, engine_options=options, **kwargs)

    decorated = option(
        "--batch_invariant",
        is_flag=True,
        help="Batch-invariant decode and verify steps: each token computed the same way however many a step "
        "computes, so that speculative decoding gives plain decoding's tokens (both with this flag) in any dtype, "
        "where bfloat16's rounding can otherwise flip a near-tie. Slower steps; not with --tp, --aot_precompile, "
        "quantized checkpoints or mixtures of experts.",
    )(command)
    decorated = option(
        "--speculate_k",
        type=int,
        default=None,
        help=f"Speculative decoding: tokens drafted per verify step. [default: {DEFAULT_SPECULATE_K}]",
    )(decorated)
    decorated = option(
        "--prompt_lookup",
        type=int,
        default=None,
        metavar="N",
        help="Speculative decoding without a second model: draft what followed the last (up to) N tokens where they "
        "occurred before, in the prompt or the text so far.",
    )(decorated)
    return option(
        "--draft_checkpoint_path",
        default=None,
        help="Speculative decoding with a draft model: a smaller checkpoint (path or ORG/NAME) sharing the "
        "target's tokenizer.",
    )(decorated)


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """``--prompt TEXT``, ``--prompt -`` (standard input, less one trailing newline) or ``--prompt_file FILE``
    (read as it is)."""
    if prompt is not None and prompt_file is not None:
        raise ValueError("give --prompt or --prompt_file, not both")
    if prompt_file is not None:
        return read_text_file(prompt_file, "--prompt_file")
    if prompt == STDOUT:  # one trailing newline, as `echo` and a terminal's Enter add it, is not part of the prompt
        return decode_utf8(sys.stdin.buffer.read(), "--prompt - (standard input)").removesuffix("\n")
    return DEFAULT_PROMPT if prompt is None else prompt


def schema_constraint(path: Path) -> OutputConstraint:
    """The constraint of the JSON Schema in the file ``--json_schema`` names."""
    from gpt_fast.generation.options import OutputConstraint
    from gpt_fast.util.fileio import read_json_object

    regular_file(path, "--json_schema")
    return OutputConstraint.from_schema(read_json_object(path))


def read_text_file(path: Path, flag: str) -> str:
    """The UTF-8 text of the file an option names; one-line errors for a missing, unreadable or binary file."""
    regular_file(path, flag)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise OSError(f"{flag} {path} cannot be read ({err.strerror})") from None
    return decode_utf8(data, f"{flag} {path}")


def decode_utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not valid UTF-8 text") from None


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def write_stderr(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


@cli.command(context_settings={"allow_extra_args": True})  # a prompt given without --prompt: a hint
@checkpoint_option
@option(
    "--prompt",
    multiple=True,
    help=f"Input prompt; - reads it from standard input; repeated, several prompts generated together. "
    f"[default: {DEFAULT_PROMPT}]",
)
@option(
    "--prompt_file", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Read the prompt from FILE."
)
@option(
    "--prompts_file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Several prompts, one per line (empty lines skipped), generated together.",
)
@option("--chat", is_flag=True, help="Apply the checkpoint's chat template to the prompt (one user turn).")
@option("--system", default=None, help="With --chat: a system message before the user turn.")
@option(
    "--max_new_tokens",
    type=int,
    default=DEFAULT_MAX_NEW_TOKENS,
    show_default=True,
    help="Maximum number of new tokens.",
)
@option(
    "--num_samples",
    type=int,
    default=DEFAULT_NUM_SAMPLES,
    show_default=True,
    help="Number of samples; the first is a warm-up (and compiles).",
)
@sampling_options
@engine_options
@speculative_options
@aot_precompile_option
@option(
    "--profile",
    default=None,
    help="Record one more sample with the PyTorch profiler (kept out of the averages) into PATH (a .json file, or "
    "a folder for trace.json) for Perfetto.",
)
@option("--batch_size", type=int, default=1, show_default=True, help="Sequences generated at once.")
@option("--seed", type=int, default=None, help="Seed for reproducible sampling (0 to 2**64-1).")
@option("--ignore_eos", is_flag=True, help="Always generate --max_new_tokens (for benchmarks).")
@option(
    "--metrics_json",
    type=click.Path(path_type=Path),
    default=None,
    help="Write all figures and token ids here as JSON (- for standard output; the report then goes to stderr).",
)
@option("--no_stream", is_flag=True, help="Print each sample's text at its end instead of token by token.")
@option(
    "--json_schema",
    type=click.Path(path_type=Path),
    default=None,
    help="Hold every answer to this JSON Schema (a .json file): the answer is one JSON document matching it.",
)
@option(
    "--tp",
    type=int,
    default=None,
    help="Tensor parallelism: split the model over N GPUs of this host, starting N processes with torchrun. "
    "[default: under torchrun, its WORLD_SIZE; else 1]",
)
@option("--profile_all_ranks", is_flag=True, help="With --tp and --profile: every rank writes its trace (PATH_rankN).")
def generate(
    checkpoint_path: str | None,
    prompt: tuple[str, ...],
    prompt_file: Path | None,
    prompts_file: Path | None,
    engine_options: EngineOptions,
    no_stream: bool,
    tp: int | None,
    sampling: dict[str, Any],
    json_schema: Path | None,
    **kwargs: Any,
) -> None:
    """Generate text and report load time, compilation time, tokens/sec, bandwidth and memory. Several prompts are
    generated together (continuous batching, as `gpt-fast serve` does)."""
    extra = click.get_current_context().args
    if extra:
        raise ValueError(f"unexpected argument {extra[0]!r}: give the prompt with --prompt {shlex.quote(extra[0])}")
    from gpt_fast.generation.options import SamplingConfig
    from gpt_fast.jobs.options import GenerateOptions

    prompts = read_prompts(prompt, prompt_file, prompts_file)
    several = tuple(prompts) if len(prompts) > 1 else ()
    if json_schema is not None and engine_options.speculative is not None:
        raise ValueError("--json_schema does not go with speculative decoding: a constrained answer is decoded plainly")
    opts = GenerateOptions(
        prompt=prompts[0],
        prompts=several,
        stream=not no_stream,
        sampling=SamplingConfig(**sampling),
        constraint=None if json_schema is None else schema_constraint(json_schema),
        **kwargs,
    )  # checked before torch is imported
    if tp is not None:
        engine_options = dataclasses.replace(engine_options, tp=tp)
    from gpt_fast.engine.engine import Engine, launched_world_size
    from gpt_fast.jobs.generate import run_generate

    if tp is None:
        engine_options = dataclasses.replace(engine_options, tp=launched_world_size())
    if several:
        engine_options.check_batching()
    engine = Engine.open(checkpoint_path, engine_options)
    if engine.world_size > 1 and engine.ranks is None:  # every check passed: start the ranks
        launch_generate(engine.world_size, STDOUT in prompt)
        return
    chosen, described = engine.sampling_choice(**sampling)
    apply_settings(engine)
    write = write_stderr if str(opts.metrics_json) == STDOUT else write_stdout
    run_generate(engine, dataclasses.replace(opts, sampling=chosen), write, sampling_note=described)


def apply_settings(engine: Engine) -> None:
    """The process's torch settings for ``engine``: its CPU threads, and inductor's settings when it compiles."""
    from gpt_fast.util.settings import apply_torch_settings

    apply_torch_settings(engine.device, compiled=engine.compile != "none", threads=engine.options.threads)


def launch_generate(tp: int, prompt_on_stdin: bool) -> None:
    """`gpt-fast generate --tp N` outside torchrun: the same command as N ranks (:mod:`gpt_fast.parallel.launch`)."""
    from gpt_fast.parallel.launch import run_ranks

    if prompt_on_stdin:
        raise ValueError("--prompt - (standard input) cannot be handed to the ranks of --tp: use --prompt_file")
    code = run_ranks(tp, ["gpt_fast", *click.get_current_context().obj["argv"]])
    if code:
        click.echo(f"error: a rank of --tp {tp} failed (torchrun exit status {code}); its error is above", err=True)
        raise click.exceptions.Exit(code)


@cli.command()
@checkpoint_option
@option("--max_new_tokens", type=int, default=512, show_default=True, help="Longest answer, in tokens.")
@option("--system", default=None, help="A system message to start the conversation with.")
@option("--seed", type=int, default=None, help="Seed for reproducible sampling (0 to 2**64-1).")
@sampling_options
@engine_options
@speculative_options
@aot_precompile_option
def chat(
    checkpoint_path: str | None,
    max_new_tokens: int,
    system: str | None,
    seed: int | None,
    sampling: dict[str, Any],
    engine_options: EngineOptions,
) -> None:
    """Chat with a model that has a chat template, streaming each answer (Ctrl-C stops an answer, Ctrl-D ends)."""
    from gpt_fast.jobs.options import check_at_least_one, check_seed

    check_seed(seed)
    check_at_least_one("max_new_tokens", max_new_tokens)
    from gpt_fast.engine.engine import Engine, set_seed, user_turn
    from gpt_fast.jobs.chat import chat_loop, check_can_chat
    from gpt_fast.jobs.generate import load_reporting

    engine = Engine.open(checkpoint_path, engine_options)
    check_can_chat(engine)
    engine.check_fits(engine.chat_ids(user_turn("?", system)), max_new_tokens)  # also checks the system message
    chosen, described = engine.sampling_choice(**sampling)
    enable_line_editing()
    apply_settings(engine)
    load_reporting(engine, write_stdout, sampling_note=described)
    set_seed(seed)
    chat_loop(engine, chosen, max_new_tokens, input, write_stdout, system)


def enable_line_editing() -> None:
    """Arrow keys and history for ``input()``, where the platform has readline."""
    try:
        import readline  # noqa: F401 - importing it is what turns line editing on
    except ImportError:
        return


cli.add_command(bench)


@bench.command("modes")
@checkpoint_option
@option(
    "--modes",
    default=",".join(COMPILE_MODES),
    show_default=True,
    help="Comma-separated compile modes, each run in a fresh process.",
)
@option("--prompt", default="def quicksort(arr):", show_default=True)
@option("--max_new_tokens", type=int, default=200, show_default=True)
@option(
    "--num_samples", type=int, default=6, show_default=True, help="Per mode; the first is a warm-up (and compiles)."
)
@option("--batch_size", type=int, default=1, show_default=True)
@sampling_options
@device_options
@speculative_options
@option("--seed", type=int, default=0, show_default=True)
@option(
    "--profile",
    default=None,
    help="Record one more sample per mode with the profiler (kept out of the figures): a folder (trace_compile_MODE"
    ".json in it) or a file prefix (PREFIX_MODE.json); each trace is summarized.",
)
@option(
    "--warm_cache",
    is_flag=True,
    help="Measure a warm start: each mode's compile cache is filled by a priming run first (default: an empty one).",
)
@option(
    "--output_dir",
    type=click.Path(path_type=Path),
    default=Path("bench_results"),
    show_default=True,
    help="Where bench.md/.json/.csv/.png and logs go.",
)
@option("--title", default=None, help="Chart title (default: the checkpoint folder's name).")
def bench_modes(
    checkpoint_path: str | None,
    modes: str,
    prompt: str,
    engine_options: EngineOptions,
    warm_cache: bool,
    output_dir: Path,
    title: str | None,
    sampling: dict[str, Any],
    **kwargs: Any,
) -> None:
    """Compare compile modes on one checkpoint: tokens/sec, TTFT, bandwidth (and its share of the measured copy
    bandwidth), compile time and whether its cache was cold or warm, memory; as Markdown, JSON, CSV and a chart."""
    from gpt_fast.bench.modes import markdown_table, parse_modes, run_bench
    from gpt_fast.engine.engine import find_checkpoint
    from gpt_fast.generation.sampling import SamplingConfig
    from gpt_fast.jobs.options import GenerateOptions

    mode_list = parse_modes(modes)
    sampling_config = SamplingConfig(**sampling)  # gpt-fast's defaults where none is given: the same in every bench
    opts = GenerateOptions(prompt=prompt, ignore_eos=True, stream=False, sampling=sampling_config, **kwargs)
    checkpoint = find_checkpoint(checkpoint_path)
    report = run_bench(
        checkpoint,
        mode_list,
        engine_options,
        opts,
        output_dir,
        warm_cache=warm_cache,
        title=title or checkpoint.resolve().name,
        command=" ".join(["gpt-fast", *sys.argv[1:]]),
        progress=lambda line: click.echo(line, err=True),
    )
    click.echo(markdown_table(report))
    if not any(r.ok for r in report.results):
        raise ValueError(f"every mode failed; see the logs in {output_dir}")


@cli.command()
@checkpoint_option
@option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (127.0.0.1: this machine only).")
@option("--port", type=int, default=8000, show_default=True, help="Port to listen on (0: a free one, printed).")
@option("--max_batch", type=int, default=8, show_default=True, help="Requests decoded together (slots of the cache).")
@option(
    "--max_seq_length",
    type=int,
    default=None,
    help="Tokens per slot, prompt and answer together. [default: the model's context, at most 2048]",
)
@option("--max_queue", type=int, default=64, show_default=True, help="Requests that may wait for a slot; more get 503.")
@option(
    "--kv_cache",
    type=Choice(KV_CACHES),
    default=KV_CACHES[0],
    show_default=True,
    help="paged: blocks taken as requests grow, a prefix cache; static: a row of max_seq_length per slot.",
)
@option("--block_size", type=int, default=16, show_default=True, help="Tokens per block of the paged KV cache.")
@option(
    "--kv_cache_tokens",
    type=int,
    default=None,
    help="The KV cache's size in tokens (whole blocks), instead of --kv_cache_memory.",
)
@option(
    "--prefill_chunk",
    type=int,
    default=None,
    help="Prefill longer prompts in chunks of this many tokens, one between two decode steps of the other requests, "
    "so that a long prompt does not stall them. [default: whole prompts]",
)
@option(
    "--kv_cache_memory",
    type=float,
    default=None,
    help="The KV cache's size: GiB (> 1), or a fraction of the device's free memory (<= 1). Requests wait, or the "
    "last admitted are preempted and resumed, when it is full. [default: max_batch sequences of max_seq_length]",
)
@option(
    "--step_sizes",
    default=None,
    help="The decode step's row counts, comma-separated (e.g. 1,8,32), each captured as a CUDA graph at start-up; a "
    "step runs the fewest that hold every busy slot. [default: those of 1,8,32 below --max_batch, and --max_batch]",
)
@option(
    "--api_key",
    default=None,
    envvar="GPT_FAST_API_KEY",
    help="Require this key (Authorization: Bearer KEY) on /v1; also read from GPT_FAST_API_KEY.",
)
@option("--model_name", default=None, help="The model's id in the API. [default: the checkpoint folder's name]")
@engine_options
def serve(checkpoint_path: str | None, engine_options: EngineOptions, **kwargs: Any) -> None:
    """An OpenAI-compatible server (chat and completions, streamed or not) that decodes concurrent requests
    together, with a chat page at /."""
    from gpt_fast.serve.options import ServeOptions

    if kwargs["step_sizes"] is not None:
        kwargs["step_sizes"] = comma_list(kwargs["step_sizes"], int, "--step_sizes")
    opts = ServeOptions(**kwargs)  # checked before torch is imported
    from gpt_fast.engine.engine import Engine
    from gpt_fast.serve.server import serve as run_server

    engine = Engine.open(checkpoint_path, engine_options)
    apply_settings(engine)
    run_server(engine, opts, write_stdout)


@cli.command("trace-summary")
@click.argument("trace", type=click.Path(path_type=Path))
@option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@option("--top", type=int, default=10, show_default=True, help="How many kernels to list.")
def trace_summary(trace: Path, as_json: bool, top: int) -> None:
    """Summarize any torch.profiler trace (plain or gzip): kernel and graph launches, GPU kernels, GPU busy share,
    idle gaps, top kernels. Over the decode phase of a `generate --profile` trace, else per ProfilerStep#N
    (torch.profiler's prof.step()), else over the whole trace; the output names the scope."""
    from gpt_fast.jobs.trace_summary import format_summary, summarize_trace

    summary = summarize_trace(trace, top=top)
    click.echo(json.dumps(summary.to_dict(), indent=2) if as_json else format_summary(summary))


def quantize_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--group_size and --quantize_output, handed to the command with the mode as ``quantization`` (a checked
    QuantConfig, or None without a mode)."""

    @functools.wraps(func)
    def command(
        *args: Any,
        quantize_mode: str | None,
        group_size: str | None,
        quantize_output: bool,
        keep_float: str | None,
        **kwargs: Any,
    ) -> Any:
        quantization = quant_config(quantize_mode, group_size, quantize_output, keep_float)
        return func(*args, quantization=quantization, **kwargs)

    decorated = option(
        "--keep_float",
        default=None,
        metavar="LAYERS",
        help="Projections to leave in the checkpoint's dtype, comma-separated (layers.0.feed_forward.w2,...).",
    )(command)
    decorated = option(
        "--quantize_output",
        is_flag=True,
        help="Quantize the output projection too (by default it stays in the checkpoint's dtype).",
    )(decorated)
    return option(
        "--group_size",
        type=Choice(tuple(str(g) for g in INT4_GROUP_SIZES)),
        default=None,
        help=f"int4: inputs per scale and zero point. [default: {DEFAULT_GROUP_SIZE}]",
    )(decorated)


def quant_config(mode: str | None, group_size: str | None, output: bool, keep_float: str | None) -> QuantConfig | None:
    if mode is None:
        if group_size is not None or output or keep_float is not None:
            raise ValueError("--group_size, --quantize_output and --keep_float go with --quantize")
        return None
    if mode == "int8" and group_size is not None:
        raise ValueError("--group_size goes with int4 (int8 has one scale per output channel)")
    size = (int(group_size) if group_size is not None else DEFAULT_GROUP_SIZE) if mode == "int4" else None
    kept = tuple(name.strip() for name in keep_float.split(",")) if keep_float is not None else ()
    try:
        return QuantConfig(mode=mode, group_size=size, output=output, keep_float=kept)
    except ValueError as err:
        raise ValueError(str(err).replace("quantization.keep_float", "--keep_float")) from None


@cli.command()
@click.argument("source", type=click.Path(path_type=Path))
@option(
    "--output_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Default: checkpoints/ORG/NAME for a downloaded checkpoints/ORG/NAME/hf, else checkpoints/<source name>.",
)
@option(
    "--dtype",
    type=Choice(DTYPE_NAMES),
    default=None,
    help="Cast the weights (default: keep the source's precision).",
)
@option("--quantize", "quantize_mode", type=Choice(QUANT_MODES), default=None, help="Also quantize: int8 or int4.")
@quantize_options
def convert(source: Path, output_dir: Path | None, dtype: str | None, quantization: QuantConfig | None) -> None:
    """Convert a Hugging Face checkpoint folder or a .gguf file into model.pth + config.json + tokenizer."""
    from gpt_fast.convert.auto import convert_source

    report_converted(convert_source(source, output_dir, dtype, quantization))


def report_converted(weights: Path) -> None:
    from gpt_fast.model.config import load_checkpoint_config

    config = load_checkpoint_config(weights.parent)
    click.echo(f"Model config {dataclasses.asdict(config.model)}")
    if config.quantization is not None:
        click.echo(f"Quantization {config.quantization.as_dict()}")
    click.echo(f"Saved checkpoint to {weights}")


@cli.command()
@checkpoint_option
@option("--mode", "quantize_mode", type=Choice(QUANT_MODES), required=True, help="int8 or int4.")
@quantize_options
@option("--output_dir", type=click.Path(path_type=Path), required=True, help="The new checkpoint folder.")
@option(
    "--device",
    default="cpu",
    show_default=True,
    metavar="[cpu|cuda|cuda:N]",
    help="Where the quantization arithmetic runs (a GPU is much faster for 7B models).",
)
@option(
    "--calibrate",
    type=Choice(CALIBRATE_METHODS),
    default=None,
    help="int4: gptq rounds with GPTQ, calibrated on a text run through the model; none rounds to nearest (no data). "
    "[default: gptq for int4, none for int8]",
)
@option(
    "--calibration_text",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="A UTF-8 text to calibrate on (default: docstrings of standard-library modules, which ship with Python; "
    "not the eval text).",
)
@option(
    "--calibration_tokens",
    type=int,
    default=None,
    help=f"Tokens of the calibration text, a multiple of 512 (its rows). [default: {CALIBRATION_TOKENS}]",
)
@option(
    "--act_order/--no_act_order",
    default=None,
    help="GPTQ: round the columns of largest input energy first (same layout). [default: on]",
)
@option(
    "--asymmetric/--no_asymmetric",
    default=None,
    help="GPTQ: fit each layer's outputs to the float model's (its inputs there), not to its own weights' outputs. "
    "[default: on]",
)
def quantize(
    checkpoint_path: str | None,
    quantization: QuantConfig,
    output_dir: Path,
    device: str,
    calibrate: str | None,
    calibration_text: Path | None,
    calibration_tokens: int | None,
    act_order: bool | None,
    asymmetric: bool | None,
) -> None:
    """Write a weight-only quantized copy of a converted checkpoint (the scheme is recorded in its config.json).
    int4 is rounded by GPTQ with act-order and asymmetric calibration in groups of 64 by default, calibrated on text
    that ships with Python; --calibrate none rounds to nearest."""
    from gpt_fast.convert.quantize import quantize_checkpoint
    from gpt_fast.engine.engine import find_checkpoint
    from gpt_fast.quant.calibrate import Calibration
    from gpt_fast.util.device import resolve_device

    calibration = None
    method = calibrate or ("gptq" if quantization.mode == "int4" else "none")
    if method == "none":
        if (
            calibration_text is not None
            or calibration_tokens is not None
            or act_order is not None
            or asymmetric is not None
        ):
            raise ValueError(
                "--calibration_text, --calibration_tokens, --act_order and --asymmetric go with --calibrate gptq"
            )
    else:
        if quantization.mode != "int4":
            raise ValueError(f"--calibrate {method} goes with --mode int4 (int8 stays within 1 % without it)")
        quantization = dataclasses.replace(quantization, method=method)
        text = None if calibration_text is None else regular_file(calibration_text, "--calibration_text")
        calibration = Calibration(
            text=None if text is None else read_text_file(text, "--calibration_text"),
            text_name=CALIBRATION_TEXT if text is None else str(text),
            tokens=CALIBRATION_TOKENS if calibration_tokens is None else calibration_tokens,
            act_order=Calibration.act_order if act_order is None else act_order,
            asymmetric=Calibration.asymmetric if asymmetric is None else asymmetric,
        )
    checkpoint = find_checkpoint(checkpoint_path)
    report_converted(quantize_checkpoint(checkpoint, output_dir, quantization, resolve_device(device), calibration))


@cli.command("eval")
@checkpoint_option
@option("--text", type=click.Path(path_type=Path, dir_okay=False), default=None, help="A UTF-8 text file to score.")
@option(
    "--dataset",
    type=Choice(EVAL_DATASETS),
    default=None,
    help="Score a dataset from the Hugging Face hub instead (wikitext-2: its test split; needs pyarrow).",
)
@option("--max_tokens", type=int, default=EVAL_MAX_TOKENS, show_default=True, help="Score the text's first N tokens.")
@option(
    "--window",
    type=int,
    default=None,
    help=f"Tokens per window, at most the model's context. [default: the context, at most {EVAL_WINDOW}]",
)
@option("--stride", type=int, default=None, help="Tokens between window starts. [default: half the window]")
@option("--json", "as_json", is_flag=True, help="Print the result as a JSON object.")
@device_options
def eval_command(
    checkpoint_path: str | None,
    text: Path | None,
    dataset: str | None,
    max_tokens: int,
    window: int | None,
    stride: int | None,
    as_json: bool,
    engine_options: EngineOptions,
) -> None:
    """Perplexity on a text with a sliding window (default text: Python's documentation topics, pydoc_data.topics,
    which ships with Python: nothing is downloaded)."""
    from gpt_fast.jobs.options import EvalOptions

    options = EvalOptions(text=text, dataset=dataset, max_tokens=max_tokens, window=window, stride=stride)
    from gpt_fast.engine.engine import Engine
    from gpt_fast.jobs.evaluate import builtin_text, run_eval

    engine = Engine.open(checkpoint_path, engine_options)
    apply_settings(engine)
    content = read_text_file(text, "--text") if text is not None else builtin_text(options)
    run_eval(engine, options, content, as_json, write_stdout, write_stderr)


LM_EVAL_MISSING = "lm-eval needs lm-evaluation-harness, which is not installed: pip install 'gpt-fast[lm-eval]'"


@cli.command("lm-eval")
@checkpoint_option
@option("--tasks", required=True, help="lm-evaluation-harness tasks or groups, separated by commas (e.g. arc_easy).")
@option(
    "--include_path",
    type=click.Path(path_type=Path),
    default=None,
    help="A folder of task YAMLs, looked up before lm-eval's own tasks.",
)
@option("--num_fewshot", type=int, default=None, help="Examples in each prompt. [default: each task's own]")
@option("--limit", type=float, default=None, help="Documents per task: a count, or a fraction below 1 (for tests).")
@option("--output_path", type=click.Path(path_type=Path), default=None, help="Write the results as JSON here.")
@engine_options
def lm_eval_command(
    checkpoint_path: str | None,
    tasks: str,
    include_path: Path | None,
    num_fewshot: int | None,
    limit: float | None,
    output_path: Path | None,
    engine_options: EngineOptions,
) -> None:
    """lm-evaluation-harness tasks on a checkpoint, in this process (the lm-eval extra); prints lm-eval's table."""
    from gpt_fast.jobs.options import LmEvalOptions

    names = tuple(name.strip() for name in tasks.split(","))
    options = LmEvalOptions(names, include_path, num_fewshot, limit, output_path)
    try:
        from gpt_fast.jobs.lm_eval_model import run_lm_eval, task_manager
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] != "lm_eval":
            raise
        raise click.ClickException(LM_EVAL_MISSING) from None
    from gpt_fast.engine.engine import Engine

    manager = task_manager(options)
    engine = Engine.open(checkpoint_path, engine_options)
    apply_settings(engine)
    run_lm_eval(engine, options, manager, write_stdout)


def hub_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """REPO_ID, --hf_token, --revision."""
    func = option("--revision", default=None, help="Branch, tag or commit (default: main).")(func)
    func = option("--hf_token", default=None, help="Hugging Face token (default: the HF_TOKEN environment variable).")(
        func
    )
    return click.argument("repo_id")(func)


@cli.command()
@hub_options
def download(repo_id: str, hf_token: str | None, revision: str | None) -> None:
    """Download a Hugging Face checkpoint's config, tokenizer and weights into checkpoints/REPO_ID/hf."""
    from gpt_fast.util.download import download as fetch

    click.echo(f"Downloaded {repo_id} to {fetch(repo_id, hf_token=hf_token, revision=revision)}")


@cli.command()
@hub_options
def prepare(repo_id: str, hf_token: str | None, revision: str | None) -> None:
    """Download REPO_ID into checkpoints/REPO_ID/hf and convert it into checkpoints/REPO_ID (the blog's prepare.sh)."""
    from gpt_fast.convert.auto import convert_source
    from gpt_fast.util.download import download as fetch

    hf_dir = fetch(repo_id, hf_token=hf_token, revision=revision)
    click.echo(f"Downloaded {repo_id} to {hf_dir}")
    report_converted(convert_source(hf_dir, hf_dir.parent))


@cli.command("random-checkpoint")
@click.argument("shape", type=Choice(tuple(SHAPES)))
@option("--output_dir", type=click.Path(path_type=Path), required=True)
@option("--dtype", type=Choice(DTYPE_NAMES), default="bfloat16", show_default=True)
@option("--seed", type=int, default=0, show_default=True)
@option(
    "--device",
    default="cpu",
    show_default=True,
    help="Where the random numbers are drawn (cuda is much faster for 7B shapes).",
)
def random_checkpoint(shape: str, output_dir: Path, dtype: str, seed: int, device: str) -> None:
    """Write a random-weight checkpoint of a named SHAPE, with a byte-level tokenizer (for benchmarks)."""
    from gpt_fast.convert.random_init import make_random_checkpoint
    from gpt_fast.util.device import parse_dtype

    path = make_random_checkpoint(
        get_shape(shape), output_dir, dtype=parse_dtype(dtype), seed=seed, device=device, source=shape
    )
    click.echo(f"Saved checkpoint to {path}")


def one_line(text: str) -> str:
    """An error message on one line: its lines joined, runs of white space folded."""
    return " ".join(text.split())


def rank_prefix() -> str:
    """Under torchrun, which rank an error comes from (``[rank 1] ``; nothing for rank 0 or a single process)."""
    rank = os.environ.get("RANK", "0")
    return f"[rank {rank}] " if rank != "0" else ""


# the options whose flag is not their name with "--" before it
FLAGS = {f"kernels.{name}": f"--{name}_kernel" for name in KERNEL_CHOICES} | {
    "speculative.prompt_lookup": "--prompt_lookup",
    "speculative.draft_checkpoint": "--draft_checkpoint_path",
    "speculative.k": "--speculate_k",
    "draft_checkpoint": "--draft_checkpoint_path",
    "k": "--speculate_k",
    "compile": "--compile",
}


def flag_of(option: str) -> str:
    """The command line's flag for a library option (``kernels.linear`` -> ``--linear_kernel``)."""
    return FLAGS.get(option, f"--{option}")


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the command, turning user errors into `error: …` on stderr."""
    args = sys.argv[1:] if argv is None else list(argv)
    prefer_passive_waits()
    try:
        code = cli.main(args=args, prog_name="gpt-fast", standalone_mode=False, obj={"argv": args})
    except click.exceptions.Abort:
        click.echo("error: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as err:
        click.echo(f"error: {one_line(err.format_message())}", err=True)
        sys.exit(err.exit_code)
    except OptionError as err:
        click.echo(f"error: {rank_prefix()}{one_line(err.naming(flag_of))}", err=True)
        sys.exit(EXIT_USER_ERROR)
    except (ValueError, OSError, MemoryError) as err:
        click.echo(f"error: {rank_prefix()}{one_line(str(err)) or type(err).__name__}", err=True)
        sys.exit(EXIT_USER_ERROR)
    sys.exit(code if isinstance(code, int) else 0)
