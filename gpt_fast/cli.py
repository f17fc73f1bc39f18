"""The `gpt-fast` command. User mistakes end as one line on stderr and a non-zero exit status."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from gpt_fast.bench import markdown_table, run_bench
from gpt_fast.config import load_checkpoint_config
from gpt_fast.convert.auto import convert_source
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.default_model import ensure_default_checkpoint
from gpt_fast.device import parse_dtype, resolve_device
from gpt_fast.download import download as fetch
from gpt_fast.generate import COMPILE_MODES
from gpt_fast.interactive import chat_loop
from gpt_fast.runner import Engine, EngineOptions, GenerateOptions, run_generate, write_stdout
from gpt_fast.sampling import SamplingConfig
from gpt_fast.settings import apply_torch_settings
from gpt_fast.shapes import get_shape
from gpt_fast.trace_summary import format_summary, summarize_trace

EXIT_USER_ERROR = 1
EXIT_INTERRUPTED = 130
GENERATE = GenerateOptions()
ENGINE = EngineOptions(checkpoint_path=Path("."))
SAMPLING = SamplingConfig()


def option(*names: str, **kwargs: object):  # noqa: ANN201 - a click decorator
    """A click option that also answers to the dashed spelling of an underscored name (--max_new_tokens, "
    "--max-new-tokens)."""
    spellings = list(names)
    for name in names:
        if name.startswith("--") and "_" in name:
            spellings.append(name.replace("_", "-"))
    return click.option(*spellings, **kwargs)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Fast LLM text generation in native PyTorch."""


def checkpoint_option(func):  # noqa: ANN001, ANN201 - a click decorator
    return option(
        "--checkpoint_path",
        type=click.Path(path_type=Path),
        default=None,
        help="A converted checkpoint's model.pth (or its folder). Default: the embedded SmolLM2-135M-Instruct.",
    )(func)


def sampling_options(func):  # noqa: ANN001, ANN201 - a click decorator
    """--temperature, --top_k, --top_p (applied in reverse so that help lists them in this order)."""
    func = option(
        "--top_p",
        type=float,
        default=SAMPLING.top_p,
        show_default=True,
        help="Nucleus sampling: keep the smallest set of tokens reaching this probability.",
    )(func)
    func = option(
        "--top_k", type=int, default=SAMPLING.top_k, show_default=True, help="Sample among the k most likely tokens."
    )(func)
    func = option("--temperature", type=float, default=SAMPLING.temperature, show_default=True, help="0 = greedy.")(
        func
    )
    return func


def engine_options(func):  # noqa: ANN001, ANN201 - a click decorator
    """--compile, --compile_prefill, --device, --dtype."""
    func = option(
        "--dtype",
        default=ENGINE.dtype,
        show_default=True,
        help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16.",
    )(func)
    func = option("--device", default=None, help="cpu or cuda[:N]. Default: cuda when present.")(func)
    func = option("--compile_prefill", is_flag=True, help="Also compile the prefill (dynamic shapes).")(func)
    func = option(
        "--compile", "compile_mode", default=ENGINE.compile, show_default=True, help=f"{', '.join(COMPILE_MODES)}."
    )(func)
    return func


def default_checkpoint_if_none(path: Path | None) -> Path:
    if path is not None:
        return path
    return ensure_default_checkpoint()


@cli.command()
@checkpoint_option
@option("--prompt", default=GENERATE.prompt, show_default=True, help="Input prompt.")
@option("--chat", is_flag=True, help="Apply the checkpoint's chat template to the prompt (one user turn).")
@option(
    "--max_new_tokens",
    type=int,
    default=GENERATE.max_new_tokens,
    show_default=True,
    help="Maximum number of new tokens.",
)
@option(
    "--num_samples",
    type=int,
    default=GENERATE.num_samples,
    show_default=True,
    help="Number of samples; the first is a warm-up (and compiles).",
)
@sampling_options
@engine_options
@option("--profile", default=None, help="Record the last sample with the PyTorch profiler into PATH.json (Perfetto).")
@option("--batch_size", type=int, default=GENERATE.batch_size, show_default=True, help="Sequences generated at once.")
@option("--seed", type=int, default=None, help="Seed for reproducible sampling.")
@option("--ignore_eos", is_flag=True, help="Always generate --max_new_tokens (for benchmarks).")
@option(
    "--metrics_json",
    type=click.Path(path_type=Path),
    default=None,
    help="Write all figures and token ids here as JSON.",
)
@option("--no_stream", is_flag=True, help="Print each sample's text at its end instead of token by token.")
def generate(
    checkpoint_path: Path | None,
    temperature: float,
    top_k: int,
    top_p: float,
    compile_mode: str,
    compile_prefill: bool,
    device: str | None,
    dtype: str,
    no_stream: bool,
    **kwargs: object,
) -> None:
    """Generate text and report load time, compilation time, tokens/sec, bandwidth and memory."""
    opts = GenerateOptions(
        sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p), stream=not no_stream, **kwargs
    )
    engine = EngineOptions(default_checkpoint_if_none(checkpoint_path), compile_mode, compile_prefill, device, dtype)
    apply_torch_settings()
    run_generate(engine, opts)


@cli.command()
@checkpoint_option
@option("--max_new_tokens", type=int, default=512, show_default=True, help="Longest answer, in tokens.")
@option("--system", default=None, help="A system message to start the conversation with.")
@sampling_options
@engine_options
def chat(
    checkpoint_path: Path | None,
    max_new_tokens: int,
    system: str | None,
    temperature: float,
    top_k: int,
    top_p: float,
    compile_mode: str,
    compile_prefill: bool,
    device: str | None,
    dtype: str,
) -> None:
    """Chat with a model that has a chat template, streaming each answer."""
    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    engine = Engine(
        EngineOptions(default_checkpoint_if_none(checkpoint_path), compile_mode, compile_prefill, device, dtype),
        write_stdout,
    )
    apply_torch_settings()
    engine.load()
    chat_loop(engine, sampling, max_new_tokens, input, system)


@cli.command()
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
@option("--device", default=None, help="cpu or cuda[:N]. Default: cuda when present.")
@option("--dtype", default=ENGINE.dtype, show_default=True)
@option("--seed", type=int, default=0, show_default=True)
@option(
    "--profile",
    type=click.Path(path_type=Path),
    default=None,
    help="Keep each mode's trace in this folder, and summarize it.",
)
@option(
    "--output_dir",
    type=click.Path(path_type=Path),
    default=Path("bench_results"),
    show_default=True,
    help="Where bench.md/.json/.csv/.png and logs go.",
)
@option("--title", default=None, help="Chart title (default: the checkpoint folder's name).")
def bench(
    checkpoint_path: Path | None,
    modes: str,
    device: str | None,
    profile: Path | None,
    output_dir: Path,
    title: str | None,
    **kwargs: object,
) -> None:
    """Compare compile modes on one checkpoint: tokens/sec, TTFT, bandwidth (and its share of the measured copy
    bandwidth), compile time, memory; as Markdown, JSON, CSV and a bar chart."""
    checkpoint = default_checkpoint_if_none(checkpoint_path)
    args = [token for name, value in kwargs.items() for token in (f"--{name}", str(value))] + ["--ignore_eos"]
    report = run_bench(
        checkpoint,
        [m.strip() for m in modes.split(",") if m.strip()],
        args,
        output_dir,
        resolve_device(device),
        profile_dir=profile,
        title=title or checkpoint.resolve().parent.name,
        command=" ".join(["gpt-fast", *sys.argv[1:]]),
        progress=lambda line: click.echo(line, err=True),
    )
    click.echo(markdown_table(report))


@cli.command("trace-summary")
@click.argument("trace", type=click.Path(path_type=Path))
@option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@option("--top", type=int, default=10, show_default=True, help="How many kernels to list.")
def trace_summary(trace: Path, as_json: bool, top: int) -> None:
    """Summarize any torch.profiler trace (plain or gzip): kernel and graph launches, GPU kernels, GPU busy share,
    idle gaps, top kernels. Over the decode phase of a `generate --profile` trace, else per ProfilerStep#N
    (torch.profiler's prof.step()), else over the whole trace; the output names the scope."""
    summary = summarize_trace(trace, top=top)
    click.echo(json.dumps(summary.to_dict(), indent=2) if as_json else format_summary(summary))


@cli.command()
@click.argument("source", type=click.Path(path_type=Path))
@option(
    "--output_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Default: checkpoints/ORG/NAME for a downloaded checkpoints/ORG/NAME/hf, else checkpoints/<source name>.",
)
@option("--dtype", default=None, help="float32, bfloat16 or float16. Default: keep the source's precision.")
def convert(source: Path, output_dir: Path | None, dtype: str | None) -> None:
    """Convert a Hugging Face checkpoint folder or a .gguf file into model.pth + config.json + tokenizer."""
    out = convert_source(source, output_dir, dtype)
    click.echo(f"Model config {dataclasses.asdict(load_checkpoint_config(out.parent).model)}")
    click.echo(f"Saved checkpoint to {out}")


@cli.command()
@click.argument("repo_id")
@option("--hf_token", default=None, help="Hugging Face token (default: the HF_TOKEN environment variable).")
@option("--revision", default=None, help="Branch, tag or commit (default: main).")
def download(repo_id: str, hf_token: str | None, revision: str | None) -> None:
    """Download a Hugging Face checkpoint's config, tokenizer and weights into checkpoints/REPO_ID/hf."""
    click.echo(f"Downloaded {repo_id} to {fetch(repo_id, hf_token=hf_token, revision=revision)}")


@cli.command("random-checkpoint")
@click.argument("shape")
@option("--output_dir", type=click.Path(path_type=Path), required=True)
@option("--dtype", default="bfloat16", show_default=True)
@option("--seed", type=int, default=0, show_default=True)
@option(
    "--device",
    default="cpu",
    show_default=True,
    help="Where the random numbers are drawn (cuda is much faster for 7B shapes).",
)
def random_checkpoint(shape: str, output_dir: Path, dtype: str, seed: int, device: str) -> None:
    """Write a random-weight checkpoint of a named SHAPE (llama-2-7b, llama-3-8b, smollm2-135m, tiny)."""
    path = make_random_checkpoint(
        get_shape(shape), output_dir, dtype=parse_dtype(dtype), seed=seed, device=device, source=shape
    )
    click.echo(f"Saved checkpoint to {path}")


def one_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the command, turning user errors into `error: …` on stderr."""
    try:
        code = cli.main(args=argv, prog_name="gpt-fast", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("error: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as err:
        click.echo(f"error: {one_line(Exception(err.format_message()))}", err=True)
        sys.exit(err.exit_code)
    except (ValueError, OSError) as err:
        click.echo(f"error: {one_line(err)}", err=True)
        sys.exit(EXIT_USER_ERROR)
    sys.exit(code if isinstance(code, int) else 0)
