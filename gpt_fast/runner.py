"""`gpt-fast generate`: validate the request, load the checkpoint, run the samples, report the figures."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gpt_fast.chat_template import chat_prompt_ids
from gpt_fast.checkpoint import check_tokenizer_size, load_model
from gpt_fast.config import CheckpointConfig, load_checkpoint_config, resolve_checkpoint_dir
from gpt_fast.device import device_name, dtype_name, memory_used, resolve_device, resolve_dtype
from gpt_fast.fileio import check_output_file, write_text_atomic
from gpt_fast.generate import COMPILE_MODES, GenerationResult, TokenCallback, cache_length, generate, make_steps
from gpt_fast.model import weight_bytes_per_token
from gpt_fast.profiling import record_trace, trace_file
from gpt_fast.sampling import SamplingConfig
from gpt_fast.textstream import TextStream
from gpt_fast.tokenizer import Tokenizer, load_tokenizer

DEFAULT_PROMPT = "Hello, my name is"
Write = Callable[[str], None]


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


@dataclass(frozen=True)
class EngineOptions:
    checkpoint_path: Path
    compile: str = "none"
    compile_prefill: bool = False
    device: str | None = None  # None: the GPU if there is one, else the CPU
    dtype: str = "auto"  # auto: bfloat16 on a GPU, float32 on the CPU


@dataclass(frozen=True)
class GenerateOptions:
    """Everything `gpt-fast generate` takes besides the engine; the CLI's defaults are these."""

    prompt: str = DEFAULT_PROMPT
    chat: bool = False
    max_new_tokens: int = 200
    num_samples: int = 5
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    profile: str | None = None
    batch_size: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    metrics_json: Path | None = None
    stream: bool = True


@dataclass(frozen=True)
class SampleMetrics:
    generated_ids: list[list[int]]  # per batch row
    text: list[str]  # per batch row
    new_tokens: int  # per row (the longest row)
    seconds: float
    tokens_per_sec: float  # new tokens per row per second (decode steps per second)
    ttft_seconds: float
    bandwidth_gbps: float  # weight bytes read per step x steps per second
    warmup: bool  # the first of several samples (it also compiles): left out of the averages


@dataclass(frozen=True)
class RunMetrics:
    checkpoint: str
    device: str
    device_name: str
    dtype: str
    compile: str
    batch_size: int
    torch_version: str
    load_seconds: float
    compile_seconds: float | None  # wall time of the first sample, which compiled
    weight_bytes_per_token: int
    prompt_ids: list[int]
    samples: list[SampleMetrics]
    average_tokens_per_sec: float
    average_ttft_seconds: float
    average_bandwidth_gbps: float
    memory_gb: float
    memory_kind: str
    trace_path: str | None


class Engine:
    """A loaded checkpoint: model, tokenizer and (compiled) step functions. Every check that needs no weights
    runs before the weights are read."""

    def __init__(self, opts: EngineOptions, write: Write) -> None:
        if opts.compile not in COMPILE_MODES:
            raise ValueError(f"--compile {opts.compile!r} is not one of {', '.join(COMPILE_MODES)}")
        self.device = resolve_device(opts.device)
        self.dtype = resolve_dtype(opts.dtype, self.device)
        self.compile = opts.compile
        self.checkpoint_dir = resolve_checkpoint_dir(opts.checkpoint_path)
        self.config: CheckpointConfig = load_checkpoint_config(self.checkpoint_dir)
        self.tokenizer: Tokenizer = load_tokenizer(self.checkpoint_dir, self.config.tokenizer)
        check_tokenizer_size(
            self.tokenizer.vocab_size, self.config.model, str(self.checkpoint_dir / self.config.tokenizer.file)
        )
        self.steps = make_steps(opts.compile, opts.compile_prefill)
        self.write = write
        self.model = None
        self.load_seconds = 0.0
        self.bytes_per_token = 0  # weight bytes read per decoded token, once loaded

    def load(self) -> None:
        self.write(
            f"Using device={self.device} ({device_name(self.device)}), dtype={dtype_name(self.dtype)}, "
            f"compile={self.compile}\n"
        )
        self.write("Loading model ...\n")
        start = time.perf_counter()
        self.model = load_model(self.checkpoint_dir, self.config, self.device, self.dtype)
        self.load_seconds = time.perf_counter() - start
        self.bytes_per_token = weight_bytes_per_token(self.model)
        self.write(f"Time to load model: {self.load_seconds:.2f} seconds\n")

    def check_fits(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """Raise ValueError (before any allocation) if the request exceeds the model's context."""
        if not prompt_ids:
            raise ValueError("the prompt encodes to no tokens")
        cache_length(len(prompt_ids), max_new_tokens, self.config.model.block_size)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, self.config.chat_template, messages)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig,
        *,
        batch_size: int = 1,
        ignore_eos: bool = False,
        on_tokens: TokenCallback | None = None,
        profile_marks: bool = False,
    ) -> GenerationResult:
        return generate(
            self.model,
            prompt_ids,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            steps=self.steps,
            batch_size=batch_size,
            stop_ids=() if ignore_eos else self.tokenizer.stop_ids,
            on_tokens=on_tokens,
            profile_marks=profile_marks,
        )

    def stream_to(self, prompt_ids: Sequence[int]) -> tuple[TextStream, TokenCallback]:
        """A text stream writing each row-0 token's text as it arrives, and the callback feeding it."""
        stream = TextStream(self.tokenizer, prompt_ids, self.write)
        return stream, lambda step: stream.push(step[0])


def validate(opts: GenerateOptions) -> None:
    """Checks that need no checkpoint: fail in a second, not after loading."""
    if not opts.prompt:
        raise ValueError("--prompt is empty")
    for name in ("max_new_tokens", "num_samples", "batch_size"):
        if getattr(opts, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(opts, name)}")
    if opts.metrics_json is not None:
        check_output_file(opts.metrics_json, "--metrics_json")


def prompt_ids(engine: Engine, opts: GenerateOptions) -> list[int]:
    if opts.chat:
        return engine.chat_ids([{"role": "user", "content": opts.prompt}])
    return engine.tokenizer.encode(opts.prompt, bos=True)


def sample_metrics(result: GenerationResult, engine: Engine, warmup: bool) -> SampleMetrics:
    tokens_per_sec = result.new_tokens / result.seconds
    return SampleMetrics(
        generated_ids=result.tokens,
        text=[engine.tokenizer.decode(row, skip_special=True) for row in result.tokens],
        new_tokens=result.new_tokens,
        seconds=result.seconds,
        tokens_per_sec=tokens_per_sec,
        ttft_seconds=result.ttft_seconds,
        bandwidth_gbps=engine.bytes_per_token * tokens_per_sec / 1e9,
        warmup=warmup,
    )


class SampleRunner:
    """The `generate` command's loop: num_samples runs of one prompt, the last one profiled if asked."""

    def __init__(self, engine: Engine, opts: GenerateOptions) -> None:
        validate(opts)
        self.engine, self.opts = engine, opts
        self.trace_path = trace_file(opts.profile) if opts.profile else None
        self.prompt_ids = prompt_ids(engine, opts)
        engine.check_fits(self.prompt_ids, opts.max_new_tokens)

    def run_sample(self, index: int) -> SampleMetrics:
        opts, engine, write = self.opts, self.engine, self.engine.write
        profiling = self.trace_path is not None and index == opts.num_samples - 1
        on_tokens = None
        if opts.stream and opts.batch_size == 1:
            write(f"{opts.prompt}\n" if opts.chat else opts.prompt)
            _, on_tokens = engine.stream_to(self.prompt_ids)
        with record_trace(self.trace_path, engine.device) if profiling else contextlib.nullcontext():
            result = engine.generate(
                self.prompt_ids,
                opts.max_new_tokens,
                opts.sampling,
                batch_size=opts.batch_size,
                ignore_eos=opts.ignore_eos,
                on_tokens=on_tokens,
                profile_marks=profiling,
            )
        metrics = sample_metrics(result, engine, warmup=index == 0 and opts.num_samples > 1)
        if opts.stream and on_tokens is None:
            for row, text in enumerate(metrics.text):
                write(f"[{row}] {opts.prompt}{text}\n")
        return metrics

    def run(self) -> RunMetrics:
        opts, write = self.opts, self.engine.write
        if opts.seed is not None:
            torch.manual_seed(opts.seed)
        samples = []
        for index in range(opts.num_samples):
            sample = self.run_sample(index)
            samples.append(sample)
            write(
                f"\nSample {index + 1}/{opts.num_samples}: {sample.new_tokens} tokens in {sample.seconds:.2f} s, "
                f"{sample.tokens_per_sec:.2f} tokens/sec, time to first token {sample.ttft_seconds * 1e3:.1f} ms, "
                f"bandwidth achieved {sample.bandwidth_gbps:.2f} GB/s{' (warm-up)' if sample.warmup else ''}\n"
            )
            if index == 0 and self.engine.compile != "none":
                write(f"Compilation time: {sample.seconds:.2f} seconds\n")
        return self.report(samples)

    def report(self, samples: list[SampleMetrics]) -> RunMetrics:
        engine = self.engine
        steady = [s for s in samples if not s.warmup]
        memory_gb, memory_kind = memory_used()
        metrics = RunMetrics(
            checkpoint=str(engine.checkpoint_dir),
            device=str(engine.device),
            device_name=device_name(engine.device),
            dtype=dtype_name(engine.dtype),
            compile=engine.compile,
            batch_size=self.opts.batch_size,
            torch_version=torch.__version__,
            load_seconds=engine.load_seconds,
            compile_seconds=samples[0].seconds if engine.compile != "none" else None,
            weight_bytes_per_token=engine.bytes_per_token,
            prompt_ids=self.prompt_ids,
            samples=samples,
            average_tokens_per_sec=statistics.fmean(s.tokens_per_sec for s in steady),
            average_ttft_seconds=statistics.fmean(s.ttft_seconds for s in steady),
            average_bandwidth_gbps=statistics.fmean(s.bandwidth_gbps for s in steady),
            memory_gb=memory_gb,
            memory_kind=memory_kind,
            trace_path=str(self.trace_path) if self.trace_path else None,
        )
        over = f" (samples 2-{len(samples)})" if len(samples) > 1 else ""
        write = engine.write
        write(f"Bandwidth achieved{over}: {metrics.average_bandwidth_gbps:.2f} GB/s\n")
        write(f"Average time to first token{over}: {metrics.average_ttft_seconds * 1e3:.1f} ms\n")
        write(f"Average tokens/sec{over}: {metrics.average_tokens_per_sec:.2f}\n")
        write(f"Memory used: {metrics.memory_gb:.2f} GB ({memory_kind})\n")
        return metrics


def run_generate(engine_opts: EngineOptions, opts: GenerateOptions, write: Write = write_stdout) -> RunMetrics:
    engine = Engine(engine_opts, write)
    runner = SampleRunner(engine, opts)
    engine.load()
    metrics = runner.run()
    if runner.trace_path is not None:
        from gpt_fast.trace_summary import short_summary, summarize_trace

        write(f"Trace written to {runner.trace_path}\n{short_summary(summarize_trace(runner.trace_path))}\n")
    if opts.metrics_json is not None:
        write_text_atomic(opts.metrics_json, json.dumps(asdict(metrics), indent=2) + "\n")
    return metrics
