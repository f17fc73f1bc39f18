"""`gpt-fast generate`: check the request, load the checkpoint, run the samples, report the figures."""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import Callable

import torch

from gpt_fast.engine.engine import Engine, EngineOptions, set_seed
from gpt_fast.generation.loop import GenerationResult
from gpt_fast.generation.metrics import RunMetrics, SampleMetrics, SpeculativeMetrics, averages_label, timed_samples
from gpt_fast.generation.speculative import SpeculativeResult
from gpt_fast.jobs.options import GenerateOptions
from gpt_fast.util.choices import HEURISTIC
from gpt_fast.util.device import memory_used
from gpt_fast.util.fileio import write_text_atomic
from gpt_fast.util.settings import cpu_threads_note

Write = Callable[[str], None]


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def compile_notes(options: EngineOptions) -> str:
    """What the first line says about compilation beyond the mode: regional, and untuned kernels."""
    notes = ["regional: one layer compiled and reused"] if options.regional_compile else []
    if options.compile != "none" and options.kernel_tuning == HEURISTIC:
        notes.append("kernels: inductor's heuristic configurations, not tuned")
    if options.batch_invariant:
        notes.append("batch-invariant steps")
    return f" ({'; '.join(notes)})" if notes else ""


def load_reporting(engine: Engine, write: Write, sampling_note: str | None = None) -> None:
    """Read the weights, saying what is loaded where (with the CPU's thread count), how it samples
    (``sampling_note``: :meth:`Engine.sampling_choice`'s line) and how long loading took (the blog's first lines)."""
    where = (
        engine.device_name
        if engine.device.type != "cpu"
        else f"{engine.device_name}, {cpu_threads_note(engine.options.threads)}"
    )
    write(
        f"Using device={engine.device} ({where}), dtype={engine.dtype_name}, "
        f"compile={engine.compile}{compile_notes(engine.options)}\n"
    )
    if engine.form_note is not None:
        write(f"Model: {engine.form_note}\n")
    if sampling_note is not None:
        write(f"Sampling: {sampling_note}\n")
    if engine.world_size > 1:
        write(f"Tensor parallel over {engine.world_size} ranks (figures are rank 0's: bandwidth and memory per GPU)\n")
    write("Loading model ...\n")
    engine.load_weights()
    write(f"Time to load model: {engine.load_seconds:.2f} seconds\n")
    if engine.drafter is not None:
        write(f"Speculative decoding: {engine.drafter.name}, {engine.drafter.k} tokens drafted per verify step\n")


class SampleRunner:
    """The `generate` command's loop: ``num_samples`` runs of one prompt, then one profiled run if asked."""

    def __init__(self, engine: Engine, opts: GenerateOptions, write: Write) -> None:
        self.engine, self.opts, self.write = engine, opts, write
        self.trace_path = opts.rank_trace_path(engine.rank)
        self.prompts_ids = [engine.encode(text, chat=opts.chat, system=opts.system) for text in opts.all_prompts]
        for ids in self.prompts_ids:
            engine.check_fits(ids, opts.max_new_tokens)
        if opts.batch_size > 1:  # one sequence's cache is checked against the weights' size when they are read
            engine.check_batch_size(opts.batch_size, len(self.prompts_ids[0]), opts.max_new_tokens)
        self.prompt_ids = self.prompts_ids[0] if len(self.prompts_ids) == 1 else self.prompts_ids

    def generate(self) -> GenerationResult:
        opts, write = self.opts, self.write
        if opts.prompts:
            return self.generate_together()
        on_text = None
        if opts.stream and opts.batch_size == 1:
            write(f"{opts.prompt}\n" if opts.chat else opts.prompt)
            on_text = write
        result = self.engine.generate_ids(
            self.prompt_ids,
            opts.max_new_tokens,
            opts.sampling,
            batch_size=opts.batch_size,
            ignore_eos=opts.ignore_eos,
            on_text=on_text,
            constraint=opts.constraint,
        )
        if opts.stream and on_text is None:
            for row, ids in enumerate(result.tokens):
                write(f"[{row}] {opts.prompt}{self.engine.decode(ids)}\n")
        return result

    def generate_together(self) -> GenerationResult:
        """Several prompts on continuous batching; each row's text printed at the end."""
        opts = self.opts
        completions = self.engine.generate_many_ids(
            self.prompts_ids, opts.max_new_tokens, opts.sampling, ignore_eos=opts.ignore_eos, constraint=opts.constraint
        )
        if opts.stream:
            for row, (text, completion) in enumerate(zip(opts.prompts, completions, strict=True)):
                self.write(f"[{row}] {text}{chr(10) if opts.chat else ''}{completion.text}\n")
        seconds = max(c.seconds for c in completions)
        return GenerationResult([c.ids for c in completions], seconds, max(c.ttft_seconds for c in completions))

    def sample(self, warmup: bool, profiled: bool) -> SampleMetrics:
        result = self.generate()
        tokens_per_sec = result.new_tokens / result.seconds
        return SampleMetrics(
            generated_ids=result.tokens,
            text=[self.engine.decode(row) for row in result.tokens],
            new_tokens=result.new_tokens,
            seconds=result.seconds,
            tokens_per_sec=tokens_per_sec,
            ttft_seconds=result.ttft_seconds,
            bandwidth_gbps=self.engine.weight_bytes_per_token * tokens_per_sec / 1e9,
            warmup=warmup,
            profiled=profiled,
            speculative=result.speculative if isinstance(result, SpeculativeResult) else None,
        )

    def run(self) -> list[SampleMetrics]:
        opts, write = self.opts, self.write
        set_seed(opts.seed)
        samples = []
        for index in range(opts.num_samples):
            sample = self.sample(warmup=index == 0, profiled=False)
            samples.append(sample)
            tag = " (warm-up)" if sample.warmup else ""
            write(f"\nSample {index + 1}/{opts.num_samples}: {describe(sample)}{tag}\n")
            if index == 0 and self.engine.compile != "none":
                cache = self.engine.compile_cache_use()
                write(f"Compilation time: {sample.seconds:.2f} seconds ({cache.description})\n")
                if self.engine.aot_package is not None:
                    write(f"Decode step ahead of time: {self.engine.aot_package}\n")
        if self.opts.trace_path is not None:  # on every rank: the collectives need them all
            profiling = self.engine.profiled(self.trace_path) if self.trace_path else contextlib.nullcontext()
            with profiling:
                sample = self.sample(warmup=False, profiled=True)
            samples.append(sample)
            write(f"\nProfiled sample: {describe(sample)} (not in the averages: the profiler slows it down)\n")
        return samples


def describe(sample: SampleMetrics) -> str:
    spec = sample.speculative
    accepted = "" if spec is None else f", {spec.tokens_per_step:.2f} tokens per verify step"
    rows = len(sample.generated_ids)
    if rows == 1:
        speed = f"{sample.new_tokens} tokens in {sample.seconds:.2f} s, {sample.tokens_per_sec:.2f} tokens/sec"
    else:
        speed = (
            f"{sample.new_tokens} tokens per sequence in {sample.seconds:.2f} s, {sample.tokens_per_sec:.2f} "
            f"tokens/sec per sequence ({aggregate_tokens_per_sec(sample):.2f} in all, {rows} sequences)"
        )
    return (
        f"{speed}, time to first token {sample.ttft_seconds * 1e3:.1f} ms, bandwidth achieved "
        f"{sample.bandwidth_gbps:.2f} GB/s{accepted}"
    )


def aggregate_tokens_per_sec(sample: SampleMetrics) -> float:
    """New tokens of every sequence together per second (rows that stopped early count what they made)."""
    return sum(len(row) for row in sample.generated_ids) / sample.seconds


def report(engine: Engine, runner: SampleRunner, samples: list[SampleMetrics], write: Write) -> RunMetrics:
    """The run's figures, printed and returned; the trace's summary with them when profiled."""
    timed = timed_samples(samples)
    memory_gb, memory_kind = memory_used()
    trace = None
    if runner.trace_path is not None:
        from gpt_fast.jobs.trace_summary import short_summary, summarize_trace

        summary = summarize_trace(runner.trace_path)
        trace = summary.to_dict()
    metrics = RunMetrics(
        checkpoint=str(engine.checkpoint_dir),
        device=str(engine.device),
        device_name=engine.device_name,
        dtype=engine.dtype_name,
        compile=engine.compile,
        batch_size=runner.opts.batch_size,
        torch_version=torch.__version__,
        load_seconds=engine.load_seconds,
        compile_seconds=samples[0].seconds if engine.compile != "none" else None,
        compile_cache=engine.compile_cache_use().label if engine.compile != "none" else None,
        weight_bytes_per_token=engine.weight_bytes_per_token,
        prompt_ids=runner.prompt_ids,
        samples=samples,
        averaged_over=averages_label(samples, compiled=engine.compile != "none"),
        average_tokens_per_sec=statistics.fmean(s.tokens_per_sec for s in timed),
        average_ttft_seconds=statistics.fmean(s.ttft_seconds for s in timed),
        average_bandwidth_gbps=statistics.fmean(s.bandwidth_gbps for s in timed),
        memory_gb=memory_gb,
        memory_kind=memory_kind,
        trace_path=str(runner.trace_path) if runner.trace_path else None,
        trace=trace,
        speculative=SpeculativeMetrics.combined([s.speculative for s in timed]) if timed[0].speculative else None,
        world_size=engine.world_size,
        aot_package=engine.aot_package,
        regional_compile=engine.options.regional_compile,
        kernel_tuning=None if engine.options.compile == "none" else engine.options.kernel_tuning,
        batch_invariant=engine.options.batch_invariant,
    )
    over = f" ({metrics.averaged_over})"
    write(f"Bandwidth achieved{over}: {metrics.average_bandwidth_gbps:.2f} GB/s\n")
    write(f"Average time to first token{over}: {metrics.average_ttft_seconds * 1e3:.1f} ms\n")
    rows = len(timed[0].generated_ids)
    if rows == 1:
        write(f"Average tokens/sec{over}: {metrics.average_tokens_per_sec:.2f}\n")
    else:
        together = statistics.fmean(aggregate_tokens_per_sec(s) for s in timed)
        write(
            f"Average tokens/sec{over}: {metrics.average_tokens_per_sec:.2f} per sequence, {together:.2f} in all "
            f"({rows} sequences)\n"
        )
    if metrics.speculative is not None:
        write(f"Speculative decoding{over}: {metrics.speculative.describe()}\n")
    write(f"Memory used: {metrics.memory_gb:.2f} GB ({memory_kind})\n")
    if runner.trace_path is not None:
        write(f"Trace written to {runner.trace_path}\n{short_summary(summary)}\n")
    return metrics


def run_generate(
    engine: Engine, opts: GenerateOptions, write: Write = write_stdout, sampling_note: str | None = None
) -> RunMetrics:
    """The whole command on an opened engine: every check, then the weights, the samples and the report. With
    tensor parallelism every rank runs it and only rank 0 prints and writes ``--metrics_json``."""
    if engine.rank != 0:
        write = write_nothing
    runner = SampleRunner(engine, opts, write)
    load_reporting(engine, write, sampling_note)
    metrics = report(engine, runner, runner.run(), write)
    if opts.metrics_json is not None and engine.rank == 0:
        write_text_atomic(opts.metrics_json, metrics.to_json())
    return metrics


def write_nothing(text: str) -> None:
    """The output of ranks other than 0."""
