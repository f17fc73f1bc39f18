"""`gpt-fast bench`: the benchmarks as subcommands, `modes` (defined with the other commands' options in
:mod:`gpt_fast.cli.main`), `decode`, `serve`, `speculative` and `tp`, each building its options object
(:mod:`gpt_fast.bench.options`) and importing its benchmark only when it runs. `gpt-fast bench [OPTIONS]` without a
subcommand is `gpt-fast bench modes [OPTIONS]`, as it was before the benchmarks were subcommands."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from gpt_fast.bench.options import (
    SERVE_DTYPES,
    WORKLOADS,
    DecodeBenchOptions,
    OptionError,
    ServeBenchOptions,
    SpeculativeBenchOptions,
    TpBenchOptions,
)
from gpt_fast.model.config import INT4_GROUP_SIZES
from gpt_fast.model.shapes import SHAPES
from gpt_fast.util.choices import COMPILE_MODES, KERNEL_TUNINGS, KV_CACHES, KV_DTYPE_CHOICES

DEFAULT_COMMAND = "modes"
T = TypeVar("T")


class BenchGroup(click.Group):
    """A group whose arguments, when they do not start with a subcommand's name (or ask for help), go to
    :data:`DEFAULT_COMMAND`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = [DEFAULT_COMMAND, *args]
        return super().parse_args(ctx, args)


class Listed(click.ParamType):
    """A value among choices that ``--help`` lists, read only when shown (some are defined beside torch code); the
    options object checks the value."""

    name = "choice"

    def __init__(self, choices: Callable[[], Sequence[Any]], kind: Callable[[str], Any] = str) -> None:
        self.choices, self.kind = choices, kind

    def get_metavar(self, param: click.Parameter, ctx: click.Context) -> str:
        return "[" + "|".join(map(str, self.choices())) + "]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return self.kind(value)
        except ValueError:
            self.fail(f"{value!r} is not one of {', '.join(map(str, self.choices()))}", param, ctx)


class TokenRange(click.ParamType):
    """``LOW-HIGH`` (or one count, ``N``: ``N-N``) -> (LOW, HIGH); the options object checks the counts."""

    name = "range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        low, dash, high = str(value).strip().partition("-")
        try:
            return int(low), int(high if dash else low)
        except ValueError:
            self.fail(f"{value!r} is not a range of token counts LOW-HIGH (64-1024)", param, ctx)


def range_text(ends: tuple[int, int]) -> str:
    return f"{ends[0]}-{ends[1]}"


SHAPE_CHOICES = Listed(lambda: tuple(SHAPES))
TOKEN_RANGE = TokenRange()
MODE_CHOICES = Listed(lambda: COMPILE_MODES)


def engine_choices(name: str) -> Listed:
    """The choices of a kernel option (``LINEAR_KERNELS``, …: :mod:`gpt_fast.accel.options`)."""

    def choices() -> Sequence[str]:
        from gpt_fast.accel import options

        return getattr(options, name)

    return Listed(choices)


def make(cls: Callable[..., T], **values: Any) -> T:
    """``cls(**values)``, an options object whose mistakes are usage errors that name their flags (``--builds must
    be …``)."""
    try:
        return cls(**values)
    except OptionError as err:
        raise click.UsageError(err.naming(lambda option: f"--{option}")) from None


def comma_list(text: str, kind: Callable[[str], T], flag: str) -> tuple[T, ...]:
    """``a,b,c`` -> its values, empty parts skipped; a part that is not a ``kind`` is refused, naming ``flag``."""
    try:
        return tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        name = getattr(kind, "__name__", "")
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of {name} values") from None


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``--tp 1,2,4`` -> (1, 2, 4)."""
    sizes = [int(part) for part in text.split(",") if part.strip().isdigit()]
    if not sizes or len(sizes) != len(text.split(",")) or min(sizes) < 1:
        raise ValueError(f"--tp {text!r} is not a comma-separated list of world sizes (1,2,4)")
    return tuple(sizes)


@click.group(
    cls=BenchGroup,
    subcommand_metavar="[COMMAND] [ARGS]...",
    epilog=f"Without a COMMAND, `gpt-fast bench [OPTIONS]` runs `gpt-fast bench {DEFAULT_COMMAND} [OPTIONS]`.",
)
def bench() -> None:
    """Benchmarks: compile modes on one checkpoint (modes, the default), decode speed against the peers (decode),
    the server under load (serve), speculative decoding (speculative), tensor parallelism (tp)."""


DECODE = DecodeBenchOptions
KERNEL_LISTS = (
    "quant_kernels",
    "attention_kernels",
    "activation_kernels",
    "layers_kernels",
    "linear_kernels",
    "sampling_kernels",
)


@bench.command("decode")
@click.option("--shape", type=SHAPE_CHOICES, default=DECODE.shape, show_default=True)
@click.option("--device", default=None, help="Default: cuda when available, else cpu.")
@click.option("--mode", type=MODE_CHOICES, default=DECODE.mode, show_default=True)
@click.option("--dtype", default=DECODE.dtype, show_default=True)
@click.option("--prompt_tokens", type=int, default=DECODE.prompt_tokens, show_default=True)
@click.option("--new_tokens", type=int, default=DECODE.new_tokens, show_default=True)
@click.option("--ttft_tokens", type=int, default=DECODE.ttft_tokens, show_default=True)
@click.option("--repeats", type=int, default=DECODE.repeats, show_default=True)
@click.option(
    "--builds",
    type=int,
    default=DECODE.builds,
    show_default=True,
    help="Build (and compile) each row this many times; tok/s is then the builds' median, their range beside it.",
)
@click.option(
    "--no_peers",
    is_flag=True,
    help="Our rows only (no transformers; no llama.cpp, whose rows need llama-cpp-python, the CPU and the default "
    "model's shape, smollm2-135m).",
)
@click.option("--greedy", is_flag=True, help="Every row samples greedily (default: top-k 200 at temperature 0.8).")
@click.option("--quantize", default="", help="Also these schemes, comma-separated: int8, int4.")
@click.option("--group_size", type=Listed(lambda: INT4_GROUP_SIZES, int), default=DECODE.group_size, show_default=True)
@click.option(
    "--quantize_table",
    is_flag=True,
    help="The --quantize rows keep a tied embedding table as int8 in groups of 32, as the default model's CPU form "
    "does.",
)
@click.option(
    "--quant_kernels",
    default="auto",
    show_default=True,
    help="The --quantize rows' products, comma-separated, as gpt-fast generate's --quant_kernel: auto, triton, "
    "gemlite, cpp, cpp-q8, aten, dequant.",
)
@click.option(
    "--attention_kernels",
    default="auto",
    show_default=True,
    help="Our rows' decode attention, comma-separated: auto, triton (fused kernel), torch (inductor).",
)
@click.option(
    "--activation_kernels",
    default="auto",
    show_default=True,
    help="Our rows' gated-MLP activation, comma-separated: auto, triton (own kernel), torch (inside the GEMV).",
)
@click.option(
    "--layers_kernels",
    default="auto",
    show_default=True,
    help="Our rows' decoder layers, comma-separated: auto, triton (one persistent kernel), torch (inductor).",
)
@click.option(
    "--linear_kernels",
    default="auto",
    show_default=True,
    help="Our rows' unquantized linear layers in one-row decode steps, comma-separated: auto, triton (our GEMV "
    "with programmatic dependent launch; our quantized kernels launched with it too), torch (cuBLAS or inductor).",
)
@click.option(
    "--sampling_kernels",
    default="auto",
    show_default=True,
    help="Our unquantized rows' top-k sampling, comma-separated: auto, triton (two kernels), torch (torch.topk).",
)
@click.option("--regional_compile", is_flag=True, help="Our rows compile one layer and reuse it for every layer.")
@click.option(
    "--kernel_tuning",
    type=Listed(lambda: KERNEL_TUNINGS),
    default=None,
    help="Our rows' kernel configurations: tuned by coordinate descent (the default), or inductor's heuristic choice.",
)
def decode_command(no_peers: bool, quantize: str, **values: Any) -> None:
    """Decode speed of gpt-fast and its peers on identical random weights (llama.cpp: on the default model)."""
    lists = {name: comma_list(values.pop(name), str, f"--{name}") for name in KERNEL_LISTS}
    quantize_names = comma_list(quantize, str, "--quantize")
    options = make(DecodeBenchOptions, peers=not no_peers, quantize=quantize_names, **lists, **values)
    from gpt_fast.bench.decode import run  # once the options are checked: it imports torch

    run(options)


SERVE = ServeBenchOptions


def token_range_option(name: str, help: str) -> Callable[[T], T]:
    """A ``LOW-HIGH`` flag of `bench serve`, its default the options object's."""
    default = range_text(getattr(SERVE, name))
    return click.option(f"--{name}", type=TOKEN_RANGE, default=default, show_default=True, help=help)


def serve_choice(name: str, choices: tuple[str, ...], help: str) -> Callable[[T], T]:
    """``--NAME``, one of ``choices``, of `bench serve`, its default the options object's."""
    return click.option(
        f"--{name}", type=Listed(lambda: choices), default=getattr(SERVE, name), show_default=True, help=help
    )


@bench.command("serve")
@click.option("--shape", type=Listed(lambda: sorted(SHAPES)), default=SERVE.shape, show_default=True)
@click.option("--workdir", default=None, help="Where the random checkpoint is written and kept for the next run.")
@click.option("--dtype", type=Listed(lambda: SERVE_DTYPES), default=SERVE.dtype, show_default=True)
@click.option("--device", default=SERVE.device, show_default=True)
@click.option("--compile", "compile_mode", type=MODE_CHOICES, default=SERVE.compile, show_default=True)
@click.option(
    "--clients",
    default=",".join(map(str, SERVE.clients)),
    show_default=True,
    help="Concurrent clients, comma-separated (1,8,32,64): a run each, and one client's, on one server with as many "
    "slots as the largest count.",
)
@click.option("--rounds", type=int, default=SERVE.rounds, show_default=True, help="Requests per client in a run.")
@click.option(
    "--workload",
    type=Listed(lambda: WORKLOADS),
    default=SERVE.workload,
    show_default=True,
    help="fixed: one prompt text, --max_tokens per answer, `gpt-fast generate` beside it; mixed: prompts of random "
    "token ids, prompt and answer lengths drawn uniformly from --prompt_tokens and --answer_tokens (from --seed).",
)
@click.option("--max_tokens", type=int, default=SERVE.max_tokens, show_default=True, help="Tokens per fixed answer.")
@token_range_option("prompt_tokens", "Mixed prompts' lengths, LOW-HIGH (or one length).")
@token_range_option("answer_tokens", "Mixed answers' lengths, LOW-HIGH (or one length); each runs to its length.")
@click.option(
    "--system_prompt_tokens",
    type=int,
    default=SERVE.system_prompt_tokens,
    show_default=True,
    help="Mixed prompts: a shared prefix of this many random token ids in front of each (what a prefix cache reuses).",
)
@click.option("--seed", type=int, default=SERVE.seed, show_default=True, help="The mixed workload's draws.")
@click.option("--temperature", type=float, default=SERVE.temperature, show_default=True)
@click.option("--top_k", type=int, default=SERVE.top_k, show_default=True)
@serve_choice("kv_cache", KV_CACHES, "The server's KV cache (gpt-fast serve --kv_cache).")
@click.option("--kv_cache_memory", type=float, default=None, help="The server's --kv_cache_memory.")
@serve_choice("kv_cache_dtype", KV_DTYPE_CHOICES, "As gpt-fast generate's option, for generate and the server.")
@serve_choice("kernel_tuning", KERNEL_TUNINGS, "As gpt-fast generate's option, for generate and the server.")
@click.option("--step_sizes", default=None, help="The server's --step_sizes (comma-separated row counts).")
@click.option("--output", default=None, help="Also write the figures here as JSON.")
def serve_command(compile_mode: str, clients: str, step_sizes: str | None, **values: Any) -> None:
    """The server under load, in one run: with the fixed workload `gpt-fast generate` alone first, then `gpt-fast
    serve` with one streaming client and with each count of --clients at once, on the same checkpoint, compile mode
    and sampling. Prints one table, a row per run: requests, tokens/sec per client (mean, slowest) and in all, time to
    first token and inter-token latency (p50/p99), the peak of KV blocks in use, prefix cache hits and preemptions;
    then the issue's ratios."""
    counts = comma_list(clients, int, "--clients")
    sizes = None if step_sizes is None else comma_list(step_sizes, int, "--step_sizes")
    options = make(ServeBenchOptions, compile=compile_mode, clients=counts, step_sizes=sizes, **values)
    from gpt_fast.bench.serve import run  # once the options are checked: it imports torch

    run(options)


SPECULATIVE = SpeculativeBenchOptions


@bench.command("speculative")
@click.option("--shape", type=SHAPE_CHOICES, default=None, help="Random weights of this shape (no tokenizer).")
@click.option("--checkpoint_path", default=None, help="A checkpoint (default: the embedded default model).")
@click.option("--draft_shape", type=SHAPE_CHOICES, default=None, help="With --shape: a random draft of this shape.")
@click.option("--draft_checkpoint_path", default=None, help="With a checkpoint: a draft checkpoint.")
@click.option("--prompt_lookup", default="", help="Comma-separated n-gram sizes for prompt-lookup rows.")
@click.option(
    "--k",
    default=",".join(map(str, SPECULATIVE.k)),
    show_default=True,
    help="Comma-separated tokens drafted per verify step.",
)
@click.option("--agreements", default=",".join(map(str, SPECULATIVE.agreements)), show_default=True)
@click.option("--prompt", default=SPECULATIVE.prompt, show_default=True)
@click.option("--prompt_file", default=None, help="Read the prompt from a file (checkpoints only).")
@click.option("--chat", is_flag=True, help="Apply the checkpoint's chat template to the prompt.")
@click.option(
    "--prompt_tokens",
    type=int,
    default=SPECULATIVE.prompt_tokens,
    show_default=True,
    help="With --shape: random prompt tokens.",
)
@click.option("--new_tokens", type=int, default=SPECULATIVE.new_tokens, show_default=True)
@click.option("--ignore_eos", is_flag=True, help="With a checkpoint: never stop at a stop token.")
@click.option("--repeats", type=int, default=SPECULATIVE.repeats, show_default=True)
@click.option("--device", default=None, help="Default: cuda when available, else cpu.")
@click.option("--mode", type=MODE_CHOICES, default=SPECULATIVE.mode, show_default=True)
@click.option("--dtype", default=SPECULATIVE.dtype, show_default=True)
@click.option(
    "--batch_invariant",
    is_flag=True,
    help="The target's steps batch-invariant (verify rounds as decode), and plain decoding with the usual kernels.",
)
@click.option("--json", default=None, help="Also write the rows as JSON here.")
def speculative_command(prompt_lookup: str, k: str, agreements: str, **values: Any) -> None:
    """Speculative decoding against plain decoding, greedy, one engine."""
    lists = {
        "k": comma_list(k, int, "--k"),
        "prompt_lookup": comma_list(prompt_lookup, int, "--prompt_lookup"),
        "agreements": comma_list(agreements, float, "--agreements"),
    }
    options = make(SpeculativeBenchOptions, **lists, **values)
    from gpt_fast.bench.speculative import run  # once the options are checked: it imports torch

    run(options)


TP = TpBenchOptions


@bench.command("tp")
@click.option("--shape", type=SHAPE_CHOICES, default=TP.shape, show_default=True)
@click.option(
    "--tp",
    default=",".join(map(str, TP.tp)),
    show_default=True,
    help="World sizes, comma-separated; each is run with torchrun.",
)
@click.option("--device", default=None, help="Default: cuda when available, else cpu.")
@click.option("--mode", type=MODE_CHOICES, default=TP.mode, show_default=True)
@click.option("--dtype", default=TP.dtype, show_default=True)
@click.option("--prompt_tokens", type=int, default=TP.prompt_tokens, show_default=True)
@click.option("--new_tokens", type=int, default=TP.new_tokens, show_default=True)
@click.option("--repeats", type=int, default=TP.repeats, show_default=True)
@click.option("--timeout", type=float, default=TP.timeout, show_default=True, help="Seconds per world size.")
@click.option("--trace_dir", default=None, help="Keep rank 0's trace of each world size here.")
@click.option("--no_profile", is_flag=True, help="No profiled generation (no collectives' time).")
@click.option("--linear_kernel", type=engine_choices("LINEAR_KERNELS"), help="As gpt-fast generate's option.")
@click.option("--attention_kernel", type=engine_choices("ATTENTION_KERNELS"), help="As gpt-fast generate's option.")
@click.option("--kernel_tuning", type=Listed(lambda: KERNEL_TUNINGS), help="As gpt-fast generate's option.")
@click.option("--worker", is_flag=True, hidden=True)
@click.option("--result", default=None, hidden=True)
def tp_command(tp: str, no_profile: bool, **values: Any) -> None:
    """Tensor-parallel decode speed over world sizes (one table)."""
    options = make(TpBenchOptions, tp=parse_world_sizes(tp), profile=not no_profile, **values)
    from gpt_fast.bench.tp import run  # once the options are checked: it imports torch

    run(options)


def run_alias(name: str) -> None:
    """`python -m gpt_fast.bench_NAME ARGS` and `python -m gpt_fast.bench.NAME ARGS`: `gpt-fast bench NAME ARGS`."""
    from gpt_fast.cli.main import main

    main(["bench", name, *sys.argv[1:]])
