"""The benchmarks' options: one object per benchmark, which checks its own values when made. Importing this module
imports no torch, so that the command line takes its defaults from these classes without loading the benchmarks.

A mistake raises :class:`OptionError`, whose message names the options as their fields are named (``builds must be
at least 1, not 0``); the command line names its flags instead (``--builds must be …``)."""

from __future__ import annotations

from dataclasses import dataclass

from gpt_fast.model.config import INT4_GROUP_SIZES, QUANT_KERNELS, QUANT_MODES
from gpt_fast.model.shapes import SHAPES
from gpt_fast.util.choices import COMPILE_MODES, COORDINATE_DESCENT, KERNEL_TUNINGS, KV_CACHES, KV_DTYPE_CHOICES
from gpt_fast.util.options import OptionError, check_at_least, check_names, check_one_of

DEFAULT_AGREEMENTS = (0.5, 0.7, 0.8, 0.9)
RUN_TIMEOUT_S = 480.0  # one world size's run of the tensor-parallel benchmark, start to end
SERVE_DTYPES = ("bfloat16", "float16", "float32")
WORKLOADS = ("fixed", "mixed")
MIXED_PROMPT_TOKENS = (64, 1024)  # the mixed workload's prompt lengths, LOW and HIGH included
MIXED_ANSWER_TOKENS = (64, 512)


def check_token_range(option: str, value: tuple[int, int]) -> None:
    """``value``: (LOW, HIGH), token counts with 1 <= LOW <= HIGH."""
    counts = isinstance(value, tuple) and len(value) == 2 and all(type(end) is int for end in value)
    if not counts or not 1 <= value[0] <= value[1]:
        shown = "-".join(map(str, value)) if counts else repr(value)
        raise OptionError(f"{option} {shown} is not a range of token counts LOW-HIGH, 1 <= LOW <= HIGH", option)


@dataclass(frozen=True)
class DecodeBenchOptions:
    """:mod:`gpt_fast.bench.decode`: our decode speed and the peers', on identical random weights of ``shape``
    (llama.cpp's rows: on the default model's GGUF, when ``shape`` is its shape, on the CPU). ``device`` None: the
    GPU when there is one; ``kernel_tuning`` None: the engine's default; ``greedy``: every row samples greedily
    (else top-k 200 at temperature 0.8); ``quantize_table``: the ``quantize`` rows keep a tied embedding table as
    int8 in groups of 32, as the default model's CPU form does (its GGUF's ``Q8_0``), not in ``dtype``."""

    shape: str = "llama-2-7b"
    device: str | None = None
    mode: str = "reduce-overhead"
    dtype: str = "bfloat16"
    prompt_tokens: int = 5
    new_tokens: int = 200
    ttft_tokens: int = 1024
    repeats: int = 5
    builds: int = 1
    peers: bool = True
    quantize: tuple[str, ...] = ()
    group_size: int = 128
    quant_kernels: tuple[str, ...] = ("auto",)
    attention_kernels: tuple[str, ...] = ("auto",)
    activation_kernels: tuple[str, ...] = ("auto",)
    layers_kernels: tuple[str, ...] = ("auto",)
    linear_kernels: tuple[str, ...] = ("auto",)
    sampling_kernels: tuple[str, ...] = ("auto",)
    regional_compile: bool = False
    kernel_tuning: str | None = None
    greedy: bool = False
    quantize_table: bool = False

    def __post_init__(self) -> None:
        check_one_of("shape", self.shape, tuple(SHAPES))
        check_one_of("mode", self.mode, COMPILE_MODES)
        if self.quantize_table and not (self.quantize and SHAPES[self.shape].tie_embeddings):
            raise OptionError(
                f"quantize_table goes with quantize, on a shape whose embedding table is its output projection "
                f"(not {self.shape})",
                "quantize_table",
            )
        for name in ("prompt_tokens", "new_tokens", "ttft_tokens", "repeats", "builds"):
            check_at_least(name, getattr(self, name), 1)
        for name in self.quantize:
            check_one_of("quantize", name, QUANT_MODES)
        check_one_of("group_size", self.group_size, INT4_GROUP_SIZES)
        check_names("quant_kernels", self.quant_kernels, QUANT_KERNELS)
        for name in ("attention_kernels", "activation_kernels", "layers_kernels", "linear_kernels", "sampling_kernels"):
            check_names(name, getattr(self, name))
        if self.kernel_tuning is not None:
            check_one_of("kernel_tuning", self.kernel_tuning, KERNEL_TUNINGS)


@dataclass(frozen=True)
class ServeBenchOptions:
    """:mod:`gpt_fast.bench.serve`: the server under load, one run for each count of ``clients`` (and one client,
    the ratios' baseline), on one server with as many slots as the largest count. ``workload`` fixed: every prompt
    one text, every answer ``max_tokens`` tokens, and `gpt-fast generate` on the same request beside them; mixed:
    each request's prompt and answer lengths drawn uniformly from ``prompt_tokens`` and ``answer_tokens`` (LOW,
    HIGH, both included), its prompt random token ids after a shared prefix of ``system_prompt_tokens``, all drawn
    from ``seed``. ``rounds``: the requests each client sends, one after another, in a run. ``workdir`` None:
    ``gpt-fast-bench-serve`` in the temporary folder."""

    shape: str = "llama-2-7b"
    workdir: str | None = None
    dtype: str = "bfloat16"
    device: str = "cuda"
    compile: str = "reduce-overhead"
    clients: tuple[int, ...] = (8,)
    rounds: int = 5
    max_tokens: int = 256
    workload: str = "fixed"
    prompt_tokens: tuple[int, int] = MIXED_PROMPT_TOKENS
    answer_tokens: tuple[int, int] = MIXED_ANSWER_TOKENS
    system_prompt_tokens: int = 0
    seed: int = 0
    temperature: float = 0.8
    top_k: int = 200
    kv_cache: str = KV_CACHES[0]
    kv_cache_memory: float | None = None
    kv_cache_dtype: str = KV_DTYPE_CHOICES[0]
    kernel_tuning: str = COORDINATE_DESCENT
    step_sizes: tuple[int, ...] | None = None
    output: str | None = None

    def __post_init__(self) -> None:
        check_one_of("shape", self.shape, tuple(SHAPES))
        check_one_of("dtype", self.dtype, SERVE_DTYPES)
        check_one_of("kernel_tuning", self.kernel_tuning, KERNEL_TUNINGS)
        check_one_of("kv_cache", self.kv_cache, KV_CACHES)
        if self.kv_cache_memory is not None:
            check_at_least("kv_cache_memory", self.kv_cache_memory, 0)
        check_one_of("kv_cache_dtype", self.kv_cache_dtype, KV_DTYPE_CHOICES)
        check_one_of("compile", self.compile, COMPILE_MODES)
        check_names("clients", self.clients)
        for count in self.clients:
            check_at_least("clients", count, 1)
        for size in self.step_sizes or ():
            check_at_least("step_sizes", size, 1)
            if size > max(self.clients):
                raise OptionError(f"step_sizes {size} exceeds the server's slots ({max(self.clients)})", "step_sizes")
        for name in ("rounds", "max_tokens", "top_k"):
            check_at_least(name, getattr(self, name), 1)
        for name in ("system_prompt_tokens", "seed", "temperature"):
            check_at_least(name, getattr(self, name), 0)
        check_one_of("workload", self.workload, WORKLOADS)
        check_token_range("prompt_tokens", self.prompt_tokens)
        check_token_range("answer_tokens", self.answer_tokens)
        if self.workload == "mixed":
            self._check_mixed()
        else:
            self._check_fixed()

    @property
    def counts(self) -> tuple[int, ...]:
        """The runs' client counts, in order: one client always, the baseline of the ratios."""
        return tuple(sorted({1, *self.clients}))

    def _check_fixed(self) -> None:
        defaults = (
            ("prompt_tokens", MIXED_PROMPT_TOKENS),
            ("answer_tokens", MIXED_ANSWER_TOKENS),
            ("system_prompt_tokens", 0),
        )
        given = [name for name, default in defaults if getattr(self, name) != default]
        if given:
            raise OptionError(f"{given[0]} needs workload mixed", given[0], "workload")

    def _check_mixed(self) -> None:
        if self.max_tokens != ServeBenchOptions.max_tokens:
            message = "max_tokens is the fixed workload's; the mixed one draws answer_tokens"
            raise OptionError(message, "max_tokens", "answer_tokens")
        longest = self.system_prompt_tokens + self.prompt_tokens[1] + self.answer_tokens[1]
        context = SHAPES[self.shape].block_size
        if longest > context:
            system = f"system_prompt_tokens {self.system_prompt_tokens} + " if self.system_prompt_tokens else ""
            message = (
                f"the longest request, {system}prompt_tokens {self.prompt_tokens[1]} + answer_tokens "
                f"{self.answer_tokens[1]} = {longest} tokens, exceeds {self.shape}'s context of {context} tokens"
            )
            raise OptionError(message, "system_prompt_tokens", "prompt_tokens", "answer_tokens")


@dataclass(frozen=True)
class SpeculativeBenchOptions:
    """:mod:`gpt_fast.bench.speculative`: speculative decoding against plain decoding, on random weights of
    ``shape`` or on a checkpoint (``checkpoint_path``; neither: the embedded default model). ``device`` None: the
    GPU when there is one."""

    shape: str | None = None
    checkpoint_path: str | None = None
    draft_shape: str | None = None
    draft_checkpoint_path: str | None = None
    prompt_lookup: tuple[int, ...] = ()
    k: tuple[int, ...] = (4,)
    agreements: tuple[float, ...] = DEFAULT_AGREEMENTS
    prompt: str = "def quicksort(arr):"
    prompt_file: str | None = None
    chat: bool = False
    prompt_tokens: int = 32
    new_tokens: int = 200
    ignore_eos: bool = False
    repeats: int = 3
    device: str | None = None
    mode: str = "reduce-overhead"
    dtype: str = "auto"
    batch_invariant: bool = False
    json: str | None = None

    def __post_init__(self) -> None:
        from gpt_fast.generation.options import check_k, check_ngram

        if self.shape is not None and self.checkpoint_path is not None:
            raise OptionError("shape and checkpoint_path exclude each other", "shape", "checkpoint_path")
        for name in ("shape", "draft_shape"):
            if getattr(self, name) is not None:
                check_one_of(name, getattr(self, name), tuple(SHAPES))
        check_names("k", self.k)
        for k in self.k:
            check_k(k)
        for n in self.prompt_lookup:
            check_ngram(n)
        check_names("agreements", self.agreements)
        if not all(0 <= a <= 1 for a in self.agreements):
            values = ",".join(map(str, self.agreements))
            raise OptionError(f"agreements must lie in [0, 1], got {values}", "agreements")
        for name in ("prompt_tokens", "new_tokens", "repeats"):
            check_at_least(name, getattr(self, name), 1)
        check_one_of("mode", self.mode, COMPILE_MODES)


@dataclass(frozen=True)
class TpBenchOptions:
    """:mod:`gpt_fast.bench.tp`: decode speed of random weights of ``shape`` split over each world size of ``tp``.
    ``device`` None: the GPU when there is one; a kernel choice None: the engine's default. ``worker`` and
    ``result``: one rank's run, started by the benchmark, writing its figures to ``result``."""

    shape: str = "llama-2-7b"
    tp: tuple[int, ...] = (1, 2, 4)
    device: str | None = None
    mode: str = "reduce-overhead"
    dtype: str = "bfloat16"
    prompt_tokens: int = 5
    new_tokens: int = 200
    repeats: int = 5
    timeout: float = RUN_TIMEOUT_S
    trace_dir: str | None = None
    profile: bool = True
    linear_kernel: str | None = None
    attention_kernel: str | None = None
    kernel_tuning: str | None = None
    worker: bool = False
    result: str | None = None

    def __post_init__(self) -> None:
        check_one_of("shape", self.shape, tuple(SHAPES))
        check_one_of("mode", self.mode, COMPILE_MODES)
        check_names("tp", self.tp)
        for size in self.tp:
            check_at_least("tp", size, 1)
        for name in ("prompt_tokens", "new_tokens", "repeats"):
            check_at_least(name, getattr(self, name), 1)
        check_at_least("timeout", self.timeout, 0)
        if self.worker and self.result is None:
            raise OptionError("worker writes its figures to result: give one", "worker", "result")
