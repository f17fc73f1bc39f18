"""The figures of a `gpt-fast generate` run, typed: what `--metrics_json` writes and what `bench` reads back."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class SampleMetrics:
    generated_ids: list[list[int]]  # per batch row
    text: list[str]  # per batch row
    new_tokens: int  # per row (the longest row)
    seconds: float
    tokens_per_sec: float  # new tokens per row per second (decode steps per second)
    ttft_seconds: float
    bandwidth_gbps: float  # weight bytes read per step x steps per second
    warmup: bool  # the first sample (it also compiles): left out of the averages unless it is the only one
    profiled: bool = False  # recorded by the profiler, slower by design: never in the averages


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
    prompt_ids: list[int] | list[list[int]]  # one prompt's, or each prompt's (several generated together)
    samples: list[SampleMetrics]
    averaged_over: str  # which samples the averages are over, e.g. "samples 2-5"
    average_tokens_per_sec: float
    average_ttft_seconds: float
    average_bandwidth_gbps: float
    memory_gb: float
    memory_kind: str
    trace_path: str | None
    trace: dict[str, Any] | None = None  # `gpt-fast trace-summary --json` of the trace, when profiled

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @property
    def timed(self) -> list[SampleMetrics]:
        """The samples the averages are over: all but the warm-up and the profiled one; the warm-up alone when it
        is the only unprofiled sample."""
        return timed_samples(self.samples)


def timed_samples(samples: list[SampleMetrics]) -> list[SampleMetrics]:
    unprofiled = [s for s in samples if not s.profiled]
    return [s for s in unprofiled if not s.warmup] or unprofiled


def averages_label(samples: list[SampleMetrics], compiled: bool) -> str:
    """What the averages are over, as printed: ``samples 2-N``, or the warm-up when it is the only sample."""
    timed = timed_samples(samples)
    if all(s.warmup for s in timed):
        return "warm-up, includes compilation" if compiled else "warm-up, includes one-time set-up"
    indexes = [i + 1 for i, s in enumerate(samples) if any(s is t for t in timed)]
    return f"samples {indexes[0]}-{indexes[-1]}"
