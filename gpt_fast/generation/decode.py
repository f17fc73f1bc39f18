"""Prefill and token-by-token decode over a static KV cache: the step functions, their compilation (compile modes,
inductor options, CUDA-graph prefills) and plain decoding's step producer for the one loop
(:mod:`gpt_fast.generation.loop`), which reads tokens back a step or two behind the device; a few tokens may be
decoded past a stop token, and are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpt_fast.generation.constraint import Matcher
from gpt_fast.generation.loop import (
    GenerationResult,
    Mark,
    Record,
    TokenCallback,
    decode_rows,
    drain,
    profile_mark,
    prompt_rows,
)
from gpt_fast.generation.precompile import PrecompiledStep
from gpt_fast.generation.profiling import DECODE_MARK
from gpt_fast.generation.sampling import SamplingConfig, mask_logits, sample
from gpt_fast.model.transformer import Transformer
from gpt_fast.util.choices import COMPILE_MODES, COORDINATE_DESCENT, KERNEL_TUNINGS
from gpt_fast.util.device import cudagraph_step_begin

CACHE_LENGTH_MULTIPLE = 64  # round cache lengths up so nearby request lengths share one compiled graph


def prefill(
    model: Transformer, idx: torch.Tensor, sampling: SamplingConfig, allowed: torch.Tensor | None = None
) -> None:
    """Run the prompt ``idx`` [B, T] through the model and leave the decode state at its first new token; with
    ``allowed`` [B, W], among the tokens a constraint allows (:func:`mask_logits`)."""
    state, length = model.decode_state, idx.shape[1]
    input_pos = torch.arange(length, device=idx.device)
    logits = model(idx, input_pos, last_only=True, from_start=True)[:, -1]  # [B, V]
    if allowed is not None:
        logits = mask_logits(logits, allowed)
    state.tokens[:, :length] = idx
    state.tokens[:, length] = sample(logits, sampling, model.top_k_sampler)
    state.input_pos.fill_(length)


def prefill_padded(model: Transformer, idx: torch.Tensor, length: torch.Tensor, sampling: SamplingConfig) -> None:
    """:func:`prefill` of a prompt padded at its end: ``idx`` [B, P] holds the prompt in its first ``length`` [1]
    positions (a device tensor, so that one CUDA graph serves every prompt padded to P). The padding's keys and
    values land in the cache after the prompt, where each decode step overwrites its own position's before
    attending to it (attention is causal), and its tokens where the decode steps write theirs."""
    state, padded = model.decode_state, idx.shape[1]
    input_pos = torch.arange(padded, device=idx.device)
    logits = model(idx, input_pos, from_start=True, last_index=length - 1)  # [B, 1, V]
    state.tokens[:, :padded] = idx
    state.tokens.index_copy_(1, length, sample(logits[:, -1], sampling, model.top_k_sampler)[:, None])
    state.input_pos.copy_(length)


def decode_one_token(model: Transformer, sampling: SamplingConfig) -> None:
    """One decode step, entirely on the device: the token at ``input_pos`` goes in, the next one is written
    after it, and ``input_pos`` advances."""
    _write_next(model, sample(_next_logits(model), sampling, model.top_k_sampler))


def decode_one_token_masked(model: Transformer, sampling: SamplingConfig, allowed: torch.Tensor) -> None:
    """:func:`decode_one_token` among the tokens a constraint allows: ``allowed`` [B, W] (:func:`mask_logits`)."""
    _write_next(model, sample(mask_logits(_next_logits(model), allowed), sampling, model.top_k_sampler))


def _write_next(model: Transformer, tokens: torch.Tensor) -> None:
    """Write the sampled ``tokens`` [B] after the token at ``input_pos``, and advance ``input_pos``."""
    state = model.decode_state
    state.tokens.index_copy_(1, state.input_pos + 1, tokens[:, None])
    state.input_pos.add_(1)


def _next_logits(model: Transformer) -> torch.Tensor:
    """The logits [B, V] after the token at ``input_pos``, its keys and values written into the cache."""
    state = model.decode_state
    cur = state.tokens.index_select(1, state.input_pos)  # [B, 1]
    # every keyword is spelled out: torch 2.11 cannot load an ahead-of-time package that guards a default argument
    # ("DefaultsSource.__init__() takes from 3 to 4 positional arguments"); tests/test_generate.py checks it
    return model(cur, state.input_pos, last_only=False, first_row=0, from_start=False, last_index=None)[:, -1]


# A prompt is padded to a multiple of this many tokens, so that few graphs serve all; the caches' multiple, so that
# a padded prompt fits the cache its request allocated.
PREFILL_GRAPH_MULTIPLE = CACHE_LENGTH_MULTIPLE
PREFILL_GRAPH_TOKENS = 256  # longer prompts prefill eagerly: their kernels take longer to run than to launch
# A compiled prefill launches far fewer kernels, and replaying them from a graph still saves 1.2 ms of a 1024-token
# prompt's 24.6 ms TTFT on the Llama-2-7B shape (docs/bench/HISTORY.md, 2026-11-25i); past 2048 tokens the same
# saving would be under 3 % of the GPU's work (an estimate, not measured).
COMPILED_PREFILL_GRAPH_TOKENS = 2048
PREFILL_GRAPHS = 8  # at most this many graphs per GraphedPrefill, never destroyed (see GraphedPrefill)


@dataclass(frozen=True)
class PrefillGraph:
    """One captured :func:`prefill_padded` and its fixed-address inputs."""

    graph: torch.cuda.CUDAGraph
    idx: torch.Tensor  # [B, P]: the prompt, then whatever tokens an earlier prompt left (valid ids, never read)
    length: torch.Tensor  # [1]

    def replay(self, idx: torch.Tensor) -> None:
        self.idx[:, : idx.shape[1]].copy_(idx)
        self.length.fill_(idx.shape[1])
        self.graph.replay()


# decode state (its caches), rows, padded length, sampling settings
PrefillKey = tuple[torch.nn.Module, int, int, SamplingConfig]
Prefill = Callable[[Transformer, torch.Tensor, SamplingConfig], None]  # prefill's signature
PaddedPrefill = Callable[[Transformer, torch.Tensor, torch.Tensor, SamplingConfig], None]  # prefill_padded's


class GraphedPrefill:
    """The prefill of prompts up to ``max_tokens`` tokens on a CUDA GPU, padded and replayed from a CUDA graph per
    (caches, rows, padded length, sampling settings); other prompts and devices, and every key after the first
    :data:`PREFILL_GRAPHS`, take the prefill unpadded. Eager by default (prompts up to
    :data:`PREFILL_GRAPH_TOKENS`); :func:`make_steps` passes both prefills compiled with ``--compile_prefill``
    (prompts up to :data:`COMPILED_PREFILL_GRAPH_TOKENS`).

    Why: an eager prefill launches about 1300 kernels one by one from Python, about 25 ms on an H200 whatever the
    model (Llama-2-7B and SmolLM2-135M shapes alike), while the GPU work of a short prompt takes 3.5 ms on the 7B
    and far less on the small model. The first prefill of each key runs as it is (the warm-up capture needs)
    and then captures. A graph is kept for as long as this object lives, even once the model has allocated new
    caches (its key then never matches again). The graphs share one memory pool, so they hold about one prefill's
    temporaries, not one each.

    cuBLAS keeps one workspace per stream, allocated at its first use: inside a capture, from the graph's pool.
    Each capture therefore starts and ends with torch's cached workspaces dropped (:func:`clear_blas_workspaces`,
    as inductor's CUDA-graph trees do around their own captures), so that a capture allocates its workspace inside
    this object's pool and nothing captured later reuses it. Otherwise a graph captured after the engine that owned
    an earlier capture was freed replays into freed memory: on an H200 with the Llama-2-7B shape, an illegal memory
    access at the first synchronize of the second engine's generation, whenever its prefill multiplies by cuBLAS
    (docs/bench/HISTORY.md, 2026-11-29; ``tests/test_gpu.py`` builds that case).
    """

    def __init__(
        self,
        padded: PaddedPrefill = prefill_padded,
        unpadded: Prefill = prefill,
        max_tokens: int = PREFILL_GRAPH_TOKENS,
    ) -> None:
        self.padded, self.unpadded, self.max_tokens = padded, unpadded, max_tokens  # eager, or both compiled
        self.graphs: dict[PrefillKey, PrefillGraph] = {}
        self.pool: tuple[int, int] | None = None  # one memory pool: the graphs never run at the same time

    def __call__(self, model: Transformer, idx: torch.Tensor, sampling: SamplingConfig) -> None:
        rows, length = idx.shape
        padded = round_up(length, PREFILL_GRAPH_MULTIPLE)
        key = (model.decode_state, rows, padded, sampling)  # the state object: new caches never match old graphs
        if key in self.graphs:
            self.graphs[key].replay(idx)
        elif (
            idx.device.type != "cuda"
            or padded > min(self.max_tokens, model.max_seq_length)
            or len(self.graphs) >= PREFILL_GRAPHS
        ):
            self.unpadded(model, idx, sampling)
        else:
            self.graphs[key] = self.capture(model, idx, padded, sampling)

    def capture(self, model: Transformer, idx: torch.Tensor, padded: int, sampling: SamplingConfig) -> PrefillGraph:
        """Prefill ``idx`` eagerly on a side stream (capture needs a warm-up run), then capture the same call."""
        static_idx = torch.zeros((idx.shape[0], padded), dtype=idx.dtype, device=idx.device)
        static_idx[:, : idx.shape[1]] = idx
        length = torch.full((1,), idx.shape[1], dtype=torch.long, device=idx.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = capture_graph(lambda: self.padded(model, static_idx, length, sampling), idx.device, self.pool)
        return PrefillGraph(graph, static_idx, length)


def capture_graph(run: Callable[[], None], device: torch.device, pool: tuple[int, int]) -> torch.cuda.CUDAGraph:
    """``run`` once on a side stream (a capture needs a warm-up run), then captured into a CUDA graph in the memory
    pool ``pool``, with cuBLAS's workspaces dropped before and after (see :class:`GraphedPrefill`)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    clear_blas_workspaces()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        run()
    clear_blas_workspaces()
    return graph


def clear_blas_workspaces() -> None:
    """Drop torch's cached cuBLAS (hipBLAS on ROCm) workspaces: the next product on each stream allocates its own.
    A build of torch without the call has nothing to drop."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


@dataclass(frozen=True)
class Steps:
    """The prefill and decode functions, compiled or not; the decode step of a constrained request
    (:func:`decode_one_token_masked`) and its prefill (:func:`prefill` with a mask, never from a CUDA graph) are
    their own graphs, compiled on first use."""

    prefill: Callable[..., torch.Tensor]
    decode: Callable[..., torch.Tensor]
    mode: str
    prefill_masked: Callable[..., None] = prefill
    decode_masked: Callable[..., None] = decode_one_token_masked


def make_steps(
    mode: str,
    compile_prefill: bool = False,
    tuning: str = COORDINATE_DESCENT,
    aot_precompile: bool = False,
    *,
    exact: bool = False,
    graph_prefill: bool = True,
) -> Steps:
    """Wrap the step functions for a compile mode (``none`` = eager). The decode step has fixed shapes, so it is
    compiled whole (``fullgraph=True``); ``reduce-overhead`` and ``max-autotune`` also capture it as a CUDA graph,
    and, with ``graph_prefill``, the prefill of short prompts, eager or (``compile_prefill``) compiled
    (:class:`GraphedPrefill`). With ``aot_precompile`` the decode step is compiled ahead of time and kept on disk
    (:mod:`gpt_fast.generation.precompile`); with ``exact``, with eager rounding (:func:`compile_options`)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if mode == "none":
        return Steps(prefill, decode_one_token, mode)
    options = compile_options(mode, tuning, exact=exact)
    if aot_precompile:
        decode: Callable[..., None] = PrecompiledStep(decode_one_token, options)
    else:
        decode = torch.compile(decode_one_token, options=options, fullgraph=True)
    masked = {"decode_masked": torch.compile(decode_one_token_masked, options=options, fullgraph=True)}
    graphs = graph_prefill and bool(options.get("triton.cudagraphs"))
    if compile_prefill:
        unpadded = compiled_prefill(tuning)
        masked["prefill_masked"] = unpadded
        if not graphs:
            return Steps(unpadded, decode, mode, **masked)
        padded = compiled_prefill(tuning, prefill_padded)
        return Steps(GraphedPrefill(padded, unpadded, COMPILED_PREFILL_GRAPH_TOKENS), decode, mode, **masked)
    return Steps(GraphedPrefill() if graphs else prefill, decode, mode, **masked)


def tuning_options(tuning: str) -> dict[str, Any]:
    """The inductor option of a kernel tuning (one of :data:`KERNEL_TUNINGS`)."""
    if tuning not in KERNEL_TUNINGS:
        raise ValueError(f"kernel tuning {tuning!r} is not one of {', '.join(KERNEL_TUNINGS)}")
    return {"coordinate_descent_tuning": tuning == COORDINATE_DESCENT}


def compile_options(mode: str, tuning: str = COORDINATE_DESCENT, *, exact: bool = False) -> dict[str, Any]:
    """Inductor options for the decode step in a compile mode: the mode's own, the kernel tuning's
    (:func:`tuning_options`), and programmatic dependent launch (PDL) in the CUDA-graph modes. With PDL each
    kernel's blocks are scheduled while the kernel before it drains, which shortens the gaps between the few
    hundred small kernels of a decode step. On an H100 it decoded the SmolLM2-135M shape 8 % faster and left the
    GEMV-bound Llama-2-7B shape unchanged (docs/bench/HISTORY.md, 2026-11-22). Inductor emits it only for CUDA GPUs of
    compute capability 9 and up, never on ROCm. ``default`` mode, which launches every kernel from the host, keeps
    inductor's launcher as it is.

    ``exact``: fused elementwise operations round to the model's dtype wherever eager PyTorch would
    (``emulate_precision_casts``), so that the same operations round alike however inductor fuses them in one
    graph or another: batch-invariant steps need it (:mod:`gpt_fast.accel.invariant`)."""
    import torch._inductor

    options: dict[str, Any] = dict(torch._inductor.list_mode_options(mode)) | tuning_options(tuning)
    if options.get("triton.cudagraphs") and hasattr(torch._inductor.config.triton, "enable_pdl"):
        options["triton.enable_pdl"] = True
    if exact:
        options["emulate_precision_casts"] = True
    return options


@dataclass(frozen=True)
class CompileCacheUse:
    """Graphs inductor loaded from its on-disk cache, and graphs it compiled afresh, in this process so far."""

    hits: int
    misses: int

    @property
    def label(self) -> str:
        """ "warm" (every graph from the cache), "cold" (none) or "partly warm"."""
        if self.misses == 0 and self.hits:
            return "warm"
        return "cold" if self.hits == 0 else "partly warm"

    @property
    def description(self) -> str:
        """In words, for a report (no graph passes through the cache when the decode step came from an
        ahead-of-time package)."""
        if self.hits + self.misses == 0:
            return "no graph went through inductor's compile cache"
        return f"compile cache {self.label}: {self.hits} of {self.hits + self.misses} graphs loaded from it"


def compile_cache_use() -> CompileCacheUse:
    """How this process's compilations used inductor's FX graph cache (torch's own counters)."""
    from torch._dynamo.utils import counters

    return CompileCacheUse(counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])


def compiled_prefill(tuning: str = COORDINATE_DESCENT, step: Callable[..., None] = prefill) -> Callable[..., None]:
    """The prefill (:func:`prefill`, or :func:`prefill_padded`) compiled once for every prompt length: the length
    dimension is marked dynamic (and only it: ``dynamic=True`` would also make the sampling settings symbolic), and
    no CUDA graphs of inductor's own (:class:`GraphedPrefill` captures the padded one)."""
    compiled = torch.compile(step, fullgraph=True, options=tuning_options(tuning))

    def prefill_any_length(model: Transformer, idx: torch.Tensor, *rest: Any) -> None:
        torch._dynamo.maybe_mark_dynamic(idx, 1)
        compiled(model, idx, *rest)

    return prefill_any_length


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``n``."""
    return -(-n // multiple) * multiple


def cache_length(prompt_length: int, max_new_tokens: int, block_size: int) -> int:
    """KV-cache length for a request, rounded up (but never beyond the model's context)."""
    needed = prompt_length + max_new_tokens
    if needed > block_size:
        raise ValueError(
            f"prompt ({prompt_length} tokens) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the model's "
            f"context of {block_size} tokens"
        )
    return min(round_up(needed, CACHE_LENGTH_MULTIPLE), block_size)


class PlainSteps:
    """Plain decoding as a step producer of the one loop (:func:`gpt_fast.generation.loop.decode_rows`):
    ``batch_size`` copies of one prompt, one token per row and step. With ``matchers`` (one per row), each row's
    tokens are held to its constraint: every token is read back and advances its row's matcher on the host before
    the next step is launched with the rows' masks (so such a generation never runs ahead of the host)."""

    def __init__(
        self,
        model: Transformer,
        prompt_ids: Sequence[int],
        sampling: SamplingConfig,
        steps: Steps,
        batch_size: int,
        mark: Mark,
        matchers: Sequence[Matcher] | None = None,
    ) -> None:
        self.model, self.sampling, self.steps, self.batch_size = model, sampling, steps, batch_size
        device = model.norm.weight.device
        self.length = len(prompt_ids)
        self.prompt = prompt_rows(prompt_ids, batch_size, device)  # [B, T]
        self.produced = 0
        self.mark = mark  # the profiler's range around each decode step
        self.matchers = matchers
        self.always_read = matchers is not None
        if matchers is not None:
            words = (batch_size, matchers[0].words)
            self.host_masks = torch.empty(words, dtype=torch.int32)  # [B, W]: pageable, staged at once by the copy
            self.masks = torch.empty(words, dtype=torch.int32, device=device)  # [B, W]

    def prefill(self) -> None:
        if self.matchers is None:
            self.steps.prefill(self.model, self.prompt, self.sampling)
        else:
            self.steps.prefill_masked(self.model, self.prompt, self.sampling, self._next_masks())
        self.produced = 1

    def step(self) -> None:
        with self.mark(DECODE_MARK):
            cudagraph_step_begin()
            if self.matchers is None:
                self.steps.decode(self.model, self.sampling)
            else:
                self.steps.decode_masked(self.model, self.sampling, self._next_masks())
        self.produced += 1

    def _next_masks(self) -> torch.Tensor:
        """Each row's mask of its next token, on the device [B, W]."""
        for row, matcher in enumerate(self.matchers):
            matcher.fill(self.host_masks[row])
        return self.masks.copy_(self.host_masks, non_blocking=True)

    def latest(self) -> tuple[torch.Tensor]:
        return (self.model.decode_state.tokens[:, self.length + self.produced - 1],)  # [B]

    def may_run_ahead(self, pending: int, budget_left: int) -> bool:
        if self.matchers is not None:  # the next masks need this step's tokens
            return pending == 0 < budget_left
        return pending < budget_left  # each step gives one token per row

    def unpack(self, record: Record) -> list[list[int]]:
        tokens = record.host[0].tolist()
        if self.matchers is not None:
            for matcher, token in zip(self.matchers, tokens, strict=True):
                matcher.advance(token)
        return [tokens]

    def all_tokens(self, produced: int) -> list[list[int]]:
        return self.model.decode_state.tokens[:, self.length : self.length + produced].tolist()

    def result(self, tokens: list[list[int]], seconds: float, ttft: float) -> GenerationResult:
        return GenerationResult(tokens, seconds, ttft)


def generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    steps: Steps,
    batch_size: int = 1,
    stop_ids: Sequence[int] = (),
    on_tokens: TokenCallback | None = None,
    profile_marks: bool = False,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` for ``batch_size`` copies of the prompt; stop early once every row has
    produced one of ``stop_ids`` (pass none to always generate ``max_new_tokens``). ``on_tokens`` receives each
    step's tokens as they arrive."""
    stream = generate_stream(
        model,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        steps=steps,
        batch_size=batch_size,
        stop_ids=stop_ids,
        emit=on_tokens is not None,
        profile_marks=profile_marks,
    )
    return drain(stream, on_tokens)


def check_request(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    """Refuse an empty prompt or a token budget below one."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompt_ids:
        raise ValueError("the prompt is empty")


@torch.no_grad()
def generate_stream(
    model: Transformer,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig,
    steps: Steps,
    batch_size: int = 1,
    stop_ids: Sequence[int] = (),
    emit: bool = True,
    profile_marks: bool = False,
    matchers: Sequence[Matcher] | None = None,
) -> Generator[list[int], None, GenerationResult]:
    """:func:`generate` as a generator: yields each step's tokens (one per batch row) once the device has produced
    them (with ``emit``; else nothing), and returns the :class:`GenerationResult`. ``matchers``: each row held to
    a constraint (:class:`PlainSteps`)."""
    check_request(prompt_ids, max_new_tokens)
    model.setup_caches(batch_size, cache_length(len(prompt_ids), max_new_tokens, model.config.block_size))
    plain = PlainSteps(model, prompt_ids, sampling, steps, batch_size, profile_mark(profile_marks), matchers)
    device = model.norm.weight.device
    return (
        yield from decode_rows(
            plain, device, max_new_tokens=max_new_tokens, stop_ids=stop_ids, emit=emit, profile_marks=profile_marks
        )
    )
