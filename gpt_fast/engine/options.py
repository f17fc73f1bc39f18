"""How a checkpoint runs: :class:`EngineOptions`, checked once as they are made. Imports no torch, so that the command
line refuses a mistake before it loads anything."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpt_fast.accel.options import KernelOptions, check_regional_compile
from gpt_fast.generation.options import SpeculativeOptions
from gpt_fast.util.choices import (
    COMPILE_MODES,
    COORDINATE_DESCENT,
    DTYPE_CHOICES,
    KERNEL_TUNINGS,
    KV_CACHES,
    KV_DTYPE_CHOICES,
)
from gpt_fast.util.options import OptionError, check_at_least, check_one_of

MAX_BATCH = 64  # slots at most
MAX_BLOCK_SIZE = 1024  # tokens per KV cache block at most

if TYPE_CHECKING:
    from gpt_fast.model.config import ModelConfig, QuantConfig


@dataclass(frozen=True)
class EngineOptions:
    """How a checkpoint runs; each value is checked when the options are made (:class:`OptionError` names the
    field).

    - ``compile``: the compile mode (``none``: eager); ``compile_prefill``: the prefill compiled too;
      ``kernel_tuning``: how inductor picks its kernels' configurations (:data:`KERNEL_TUNINGS`);
    - ``device`` (None: the GPU if there is one) and ``dtype`` (``auto``: bfloat16 on a GPU, float32 on the CPU);
    - ``kv_cache_dtype``: the KV cache's dtype (``auto``: the model's), keys and values rounded to it as they are
      written (docs/cpu.md, "A narrower KV cache"; ``float8_e4m3fn``: docs/serving.md, "A float8 KV cache");
    - ``speculative``: speculative decoding (None: plain decoding), :mod:`gpt_fast.generation.speculative`;
    - ``kernels``: the kernel of each operation (:class:`gpt_fast.accel.options.KernelOptions`, resolved by
      :mod:`gpt_fast.accel.registry`);
    - ``tp``: the model split over that many processes started by ``torchrun``, one GPU each
      (:mod:`gpt_fast.parallel.tensor_parallel`);
    - ``regional_compile``: one layer compiled and reused for all (:func:`gpt_fast.model.transformer.layer_region`);
    - ``aot_precompile``: the decode step compiled ahead of time and kept on disk for the next process
      (:mod:`gpt_fast.generation.precompile`; one prompt's plain decoding in one process);
    - ``batch_invariant``: every decode and verify step computes each token's row on its own, so that speculative
      decoding gives plain decoding's tokens in any dtype (:mod:`gpt_fast.accel.invariant`);
    - ``threads``: torch's CPU threads for the commands (None: :func:`gpt_fast.util.settings.cpu_threads`' choice).
    """

    compile: str = "none"
    compile_prefill: bool = False
    device: str | None = None
    dtype: str = "auto"
    speculative: SpeculativeOptions | None = None
    kernels: KernelOptions = field(default_factory=KernelOptions)
    tp: int = 1
    regional_compile: bool = False
    kernel_tuning: str = COORDINATE_DESCENT
    aot_precompile: bool = False
    batch_invariant: bool = False
    threads: int | None = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_one_of("compile", self.compile, COMPILE_MODES)
        check_one_of("dtype", self.dtype, DTYPE_CHOICES)
        check_one_of("kv_cache_dtype", self.kv_cache_dtype, KV_DTYPE_CHOICES)
        check_one_of("kernel_tuning", self.kernel_tuning, KERNEL_TUNINGS)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeOptions):
            raise OptionError(f"speculative must be a SpeculativeOptions or None, got {self.speculative!r}")
        if not isinstance(self.kernels, KernelOptions):
            raise OptionError(f"kernels must be a KernelOptions, got {self.kernels!r}")
        check_at_least("tp", self.tp, 1)
        if self.threads is not None:
            check_at_least("threads", self.threads, 1)
        if self.tp > 1 and self.speculative is not None:
            raise OptionError("speculative decoding does not run with tensor parallelism (tp) yet", "tp")
        if self.kernels.layers == "triton" and (self.tp > 1 or self.speculative is not None):
            raise OptionError(
                "kernels.layers triton runs plain decoding on one GPU (no tp, no speculation)", "kernels.layers", "tp"
            )
        if self.regional_compile and self.tp > 1:  # collectives inside a reused region: not tried on GPUs yet
            raise OptionError(
                "regional_compile does not run with tensor parallelism (tp) yet", "regional_compile", "tp"
            )
        check_regional_compile(self.kernels.attention, self.regional_compile)
        self._check_aot_precompile()
        self._check_batch_invariant()

    def _check_batch_invariant(self) -> None:
        if not self.batch_invariant:
            return
        others = {
            "tp": self.tp > 1,
            "aot_precompile": self.aot_precompile,
            "kv_cache_dtype": self.kv_cache_dtype != "auto",  # the invariant kernels read the model's dtype
        }
        for name in self.kernels.asked_for("triton"):
            others[f"kernels.{name} triton"] = name not in ("quant", "sampling")
        others["kernels.quant gemlite"] = self.kernels.quant == "gemlite"  # its kernels change with the rows
        for name, used in others.items():
            if used:
                raise OptionError(f"batch_invariant does not combine with {name}", "batch_invariant", name.split()[0])

    def _check_aot_precompile(self) -> None:
        if not self.aot_precompile:
            return
        if self.compile == "none":
            raise OptionError(
                "aot_precompile keeps a compiled decode step: give it a compile mode", "aot_precompile", "compile"
            )
        others = {
            "regional_compile": self.regional_compile,
            "tp": self.tp > 1,
            "speculative decoding": self.speculative is not None,
            "kernels.layers triton": self.kernels.layers == "triton",
        }
        for name, used in others.items():
            if used:
                raise OptionError(f"aot_precompile does not combine with {name} yet", "aot_precompile", name.split()[0])

    def check_parallel(self, config: ModelConfig, quantization: QuantConfig | None) -> None:
        """A model that does not split over ``tp`` ranks is refused before any weights are read."""
        from gpt_fast.parallel.tensor_parallel import check_tensor_parallel

        check_tensor_parallel(config, quantization, self.tp)

    def check_batching(self) -> None:
        """Continuous batching (several prompts, `gpt-fast serve`) decodes without speculation: a verify step keeps
        one accepted length for all its rows, which independent requests do not share."""
        if self.speculative is not None:
            raise OptionError(
                "speculative decoding (speculative.prompt_lookup, speculative.draft_checkpoint) takes one prompt; "
                "several prompts are decoded together without it",
                "speculative.prompt_lookup",
                "speculative.draft_checkpoint",
            )
        if self.tp > 1:  # the batcher's host-side decisions follow the device's timing, which differs by rank
            raise ValueError("several prompts (continuous batching, serve) do not run with tensor parallelism yet")
        if self.aot_precompile:  # the batcher's slot steps are other functions, compiled as usual
            message = "aot_precompile keeps one prompt's decode step; several prompts (serve) do not use it"
            raise OptionError(message, "aot_precompile")


@dataclass(frozen=True)
class BatchOptions:
    """The slots, the cache and the queue: up to ``max_batch`` requests decoded together, each of at most
    ``max_seq_length`` tokens (None: the model's context), and up to ``max_queue`` more waiting for a slot.

    The KV cache is paged (``kv_cache``), in blocks of ``block_size`` tokens. It holds ``kv_cache_memory`` (GiB when
    more than 1, else that fraction of the device's free memory) or ``kv_cache_tokens`` (in whole blocks); neither:
    enough for every slot to hold ``max_seq_length`` tokens. ``kv_cache="static"``: a row of ``max_seq_length``
    tokens per slot, no prefix cache, and for a slot decoding alone the fused one-row kernels (docs/serving.md,
    "Continuous batching"). ``prefill_chunk``: a prompt longer than that goes in by chunks of that many tokens, one
    between two decode steps of the other requests (None: whole, before the next step). ``step_sizes``: the decode
    step's row counts, each compiled (and captured as a CUDA graph) once; a step runs the smallest that holds every
    busy slot, slots being taken lowest first (``max_batch`` is always one; None: :data:`STEP_SIZES` below
    ``max_batch``, or for eager steps every power of two below it: :func:`step_rows`)."""

    max_batch: int = 8
    max_seq_length: int | None = None
    max_queue: int = 64
    block_size: int = 16
    kv_cache_memory: float | None = None
    kv_cache_tokens: int | None = None
    kv_cache: str = "paged"
    prefill_chunk: int | None = None
    step_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        require_int(self.max_batch, "max_batch", 1, MAX_BATCH)
        for size in self.step_sizes or ():
            require_int(size, "step_sizes", 1, self.max_batch)
        require_int(self.max_queue, "max_queue", 0)
        require_int(self.block_size, "block_size", 1, MAX_BLOCK_SIZE)
        if self.max_seq_length is not None:
            require_int(self.max_seq_length, "max_seq_length", 2)
        memory = self.kv_cache_memory
        if memory is not None and (
            isinstance(memory, bool) or not isinstance(memory, int | float) or not 0 < memory < float("inf")
        ):
            message = f"kv_cache_memory must be a number of GiB (> 1) or a fraction (0 < f <= 1), got {memory!r}"
            raise OptionError(message, "kv_cache_memory")
        check_one_of("kv_cache", self.kv_cache, KV_CACHES)
        if self.prefill_chunk is not None:
            require_int(self.prefill_chunk, "prefill_chunk", 1)
        if self.kv_cache_tokens is not None:
            require_int(self.kv_cache_tokens, "kv_cache_tokens", 1)
            if memory is not None:
                raise OptionError(
                    "give kv_cache_memory or kv_cache_tokens, not both", "kv_cache_memory", "kv_cache_tokens"
                )
        for name in ("kv_cache_memory", "kv_cache_tokens"):
            if self.kv_cache == "static" and getattr(self, name) is not None:
                raise OptionError(f"{name} sizes the paged cache, not a static one", name, "kv_cache")


# The decode step's row counts unless told (with max_batch): on an H200, Llama-2-7B shape, 64 slots, 8 clients got
# 1271.9 tok/s in all with these against 1078.6 with 1 and 64 alone, 32 clients 2719.1 against 2566.3 (BENCHMARKS.md,
# 2026-11-29, "server with prompts prefilled together")
STEP_SIZES = (1, 8, 32)


def step_rows(options: BatchOptions, compiled: bool = True) -> tuple[int, ...]:
    """The decode step's row counts, ascending, ``max_batch`` the last (:attr:`BatchOptions.step_sizes`). Eager steps
    (not ``compiled``) cost nothing per row count, so unless told they take every power of two: a step of 3 rows
    runs 4, not 8 (each row's products cost our CPU kernels time of their own: docs/cpu.md, "Serving")."""
    defaults = STEP_SIZES if compiled else tuple(1 << i for i in range(options.max_batch.bit_length()))
    sizes = options.step_sizes or tuple(size for size in defaults if size < options.max_batch)
    return tuple(sorted({*sizes, options.max_batch}))


def require_int(value: object, name: str, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise OptionError(f"{name} must be an integer {bounds}, got {value!r}", name)
