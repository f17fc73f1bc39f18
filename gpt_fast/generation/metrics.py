"""The figures of a `gpt-fast generate` run, typed: what `--metrics_json` writes and what `bench` reads back."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class SpeculativeMetrics:
    """The figures of speculative decoding over one or more generations. A round is one verify step of the target
    over k + 1 positions, after the drafter's k proposals; rounds the host had already started when the generation
    ended count too."""

    drafter: str
    k: int
    rounds: int
    accepted: int  # proposals the target kept
    acceptance_rate: float  # accepted / (rounds x k)
    tokens_per_step: float  # new tokens per verify step: accepted / rounds + 1
    verify_seconds: float
    verify_ms_per_step: float
    draft_seconds: float
    draft_ms_per_step: float  # the drafting of a round (k draft-model steps, or one lookup)

    @classmethod
    def of(
        cls, drafter: str, k: int, rounds: int, accepted: int, verify_seconds: float, draft_seconds: float
    ) -> SpeculativeMetrics:
        per_round = max(rounds, 1)
        return cls(
            drafter=drafter,
            k=k,
            rounds=rounds,
            accepted=accepted,
            acceptance_rate=accepted / (per_round * k),
            tokens_per_step=accepted / per_round + 1,
            verify_seconds=verify_seconds,
            verify_ms_per_step=1e3 * verify_seconds / per_round,
            draft_seconds=draft_seconds,
            draft_ms_per_step=1e3 * draft_seconds / per_round,
        )

    @classmethod
    def combined(cls, parts: list[SpeculativeMetrics]) -> SpeculativeMetrics:
        """The figures of several generations together (rates weighted by their rounds)."""
        return cls.of(
            parts[0].drafter,
            parts[0].k,
            sum(p.rounds for p in parts),
            sum(p.accepted for p in parts),
            sum(p.verify_seconds for p in parts),
            sum(p.draft_seconds for p in parts),
        )

    def describe(self) -> str:
        return (
            f"{self.drafter}, k={self.k}: acceptance {self.acceptance_rate:.1%}, {self.tokens_per_step:.2f} "
            f"tokens per verify step ({self.rounds} steps), draft {self.draft_ms_per_step:.2f} ms/step, verify "
            f"{self.verify_ms_per_step:.2f} ms/step"
        )


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
    speculative: SpeculativeMetrics | None = None  # with speculative decoding


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
    compile_cache: str | None  # warm, cold or partly warm: how the compilations used inductor's on-disk cache
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
    speculative: SpeculativeMetrics | None = None  # over the samples the averages are over
    world_size: int = 1  # processes the model was split over (tensor parallelism); the figures are rank 0's
    aot_package: str | None = None  # with --aot_precompile: the decode step's package, loaded or compiled and saved
    regional_compile: bool = False  # one layer compiled and reused for every layer (EngineOptions.regional_compile)
    kernel_tuning: str | None = None  # EngineOptions.kernel_tuning of a compiled run; None in eager mode
    batch_invariant: bool = False  # each token's row computed on its own (EngineOptions.batch_invariant)

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
