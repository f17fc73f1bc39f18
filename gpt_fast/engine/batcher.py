"""Continuous batching: requests for one model decoded together, on the steps of :mod:`gpt_fast.generation.slots`.

A request waits in a bounded queue for a free slot (one of ``max_batch``) and for the KV cache's blocks its prompt
needs, is prefilled into its slot (with a paged cache, together with the others admitted at the same time, in one
CUDA graph in the CUDA-graph modes), and from the next step on is decoded together with every other busy slot,
each at its own position, with its own sampling settings and seed. A request that finishes (a stop token, a stop
string, its token budget) or is cancelled (its client went away) frees its slot and its blocks at once, for the next
request in the queue.

The KV cache is paged (:class:`gpt_fast.model.cache.PagedKVCache`): a sequence holds blocks of ``block_size``
positions as it grows, so the tokens in use, not ``max_batch`` times the longest possible sequence, take the memory.
The host keeps each slot's blocks (:class:`gpt_fast.engine.kv_blocks.BlockAllocator`) and writes the slot's row of
the block table before the step that first writes a new block. When none is left, the request admitted last gives
its blocks back: it waits again at the head of the queue and, readmitted, prefills its prompt and what it has
generated so far, and goes on as it would have (greedy or seeded, its tokens are the same). A prompt's full blocks
stay in the cache after their request ends, as a prefix cache: a later prompt that starts with the same tokens (a
shared system prompt, the earlier turns of a chat) takes those blocks and prefills only the rest. With
``prefill_chunk``, a long prompt goes in by chunks, one between two decode steps, in which its slot takes no token.
The static cache (``kv_cache="static"``) gives each slot a row of ``max_seq_length`` positions instead.

The decode step runs the first ``rows`` slots, the fewest of a few fixed counts (``step_sizes``; unless told, those
of 1, 8 and 32 below ``max_batch``, and all slots) that hold every busy slot; slots are taken lowest first, and a
slot with no sequence stays at position 0, where its attention reads one position. Each count has fixed shapes
(with the static cache and slot 0 alone, a single client decodes as fast as a single stream). The batcher is a
step producer of the one decode loop (:mod:`gpt_fast.generation.loop`), as plain and speculative decoding are: the
host never waits for the step it has just launched; each step's tokens are copied to host memory and handed out once
the device has produced them, while the next step runs; a slot whose request has just finished may decode once
more, harmlessly, before the host frees it.

A request held to a constraint (:class:`~gpt_fast.generation.options.OutputConstraint`: a JSON schema, tool calls)
gets its grammar matcher when it is submitted (a constraint the engine refuses is refused there). Its next token's
mask depends on its last token, which the host reads back and hands to the matcher: so the steps it takes part in
never run ahead of the host. While a constrained slot waits for its mask, the steps launched ahead hold it as it is
(:mod:`gpt_fast.generation.slots`) and the other slots go on; the masked steps run only while a constrained request
is in a slot, so that the others pay nothing for constraints otherwise.

One thread drives a :class:`Batcher`: :meth:`Batcher.serve_forever` (a server) or :meth:`Batcher.run` (until every
submitted request is done). :meth:`Batcher.submit` and :meth:`Batcher.cancel` may be called from any thread; the
events of a request go to its callback, on the driving thread. The driving thread should be the one that compiles
(the main thread): in the CUDA-graph modes, torch's inductor keeps its CUDA-graph trees per thread, and some
versions (torch 2.11) set them up only in the thread that first loaded that part of inductor, in practice the one
that compiled first. So the clients get the other threads: :meth:`Batcher.serve_while` serves in the calling
thread while a thread of its own submits the requests.
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from gpt_fast.engine.kv_blocks import BlockAllocator
from gpt_fast.engine.options import BatchOptions, require_int, step_rows
from gpt_fast.generation.constraint import GrammarError, Matcher
from gpt_fast.generation.loop import Readbacks, Record, run_steps, turn
from gpt_fast.generation.options import LogitAdjustments, OutputConstraint, SamplingConfig
from gpt_fast.generation.sampling import seed_key
from gpt_fast.generation.slots import (
    PREFILL_ROWS,
    TOP_LOGPROBS,
    RowPrefill,
    RowPrefills,
    SlotState,
    SlotSteps,
    extend_slot,
    move_rows,
    prefill_shape,
    score_slot,
)
from gpt_fast.model.transformer import Transformer
from gpt_fast.text.textstream import Decoder, StopStrings, TextStream
from gpt_fast.util.device import cudagraph_step_begin, device_free_bytes, device_synchronize
from gpt_fast.util.options import OptionError

MAX_STOP_TEXTS = 16
IN_FLIGHT_STEPS = 2  # decode steps launched and not yet handed out, at most: the device always has the next one


def masked_step(masked: bool) -> dict[str, bool]:
    """The keyword of a step's masked form (:mod:`gpt_fast.generation.slots`): none for the plain one, which is
    called as it always was."""
    return {"masked": True} if masked else {}


class QueueFull(RuntimeError):
    """Every slot is busy and the queue of waiting requests is full."""


@dataclass(frozen=True)
class Request:
    """What to generate: up to ``max_new_tokens`` after ``prompt_ids``, stopping early at one of the checkpoint's
    stop tokens (unless ``ignore_eos``), of ``stop_ids`` or at one of ``stop_texts`` (left out of the text). With
    ``top_logprobs`` (0 to 20), each token comes with its log-probability and that many alternatives'. With
    ``prompt_logprobs`` (0 to 20), the prompt's tokens too, before the first new one (:class:`PromptLogprobs`);
    ``max_new_tokens`` may then be 0 (the prompt scored, nothing generated). ``adjust``: penalties, a logit bias and
    min-p (:class:`gpt_fast.generation.options.LogitAdjustments`). ``constraint``: what the answer must match (it
    ends once the constraint is complete). ``seed`` makes the sampled tokens reproducible, whatever else is decoded
    at the same time (None: a random seed)."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    stop_texts: tuple[str, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    adjust: LogitAdjustments = field(default_factory=LogitAdjustments)
    constraint: OutputConstraint | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (before temperature and filtering), and the most likely tokens'
    (None for a prompt's first token, which follows nothing)."""

    token: int
    text: str
    logprob: float | None
    top: tuple[tuple[int, str, float], ...]  # (token, text, log-probability), most likely first


@dataclass(frozen=True)
class Delta:
    """One new token, and the text it adds (empty while text is held back: an incomplete UTF-8 sequence, or what
    may be the start of a stop string)."""

    token: int
    text: str
    logprob: TokenLogprob | None


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's tokens with their log-probabilities (``Request.prompt_logprobs``), before any :class:`Delta`."""

    items: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (a stop token or string), "length" (max_new_tokens) or "cancelled"
    prompt_tokens: int
    ids: tuple[int, ...]  # the new tokens, a stop token included
    text: str  # all the text given out
    ttft_seconds: float | None  # from submission to the first token handed out
    seconds: float  # from submission to the end

    @property
    def completion_tokens(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 500  # 400: the request's own mistake (its constraint, which the grammar engine gave up on)


Event = PromptLogprobs | Delta | Finished | Failed


@dataclass(frozen=True)
class CacheUsage:
    """The KV cache's blocks at one moment, and what the prefix cache has saved since the batcher started."""

    block_size: int  # tokens per block
    blocks: int  # blocks the sequences may hold
    blocks_used: int  # blocks held by the requests in the slots
    blocks_peak: int  # the most held when a step was launched, since the batcher started or Batcher.reset_peak
    prefix_tokens_queried: int  # prompt tokens looked up in the prefix cache
    prefix_tokens_hit: int  # of those, the tokens whose keys and values were found already computed
    preemptions: int  # requests taken out of their slot to free blocks, and resumed later


class Job:
    """A submitted request: its slot, what it has generated, and whom to tell."""

    def __init__(
        self,
        request: Request,
        on_event: Callable[[Event], None],
        tokenizer: Decoder | None,
        stop_ids: Sequence[int],
        matcher: Matcher | None = None,
    ) -> None:
        self.request = request
        self.on_event = on_event
        self.matcher = matcher  # the constraint's place, advanced by each token handed out
        self.awaiting = False  # a step launched with this constrained slot has not been handed out yet
        self.mask_stale = False  # its next mask is on the host, not yet in the slot's state
        self.key = seed_key(secrets.randbits(64) if request.seed is None else request.seed)
        self.stop_ids = frozenset(request.stop_ids) | frozenset(() if request.ignore_eos else stop_ids)
        self.slot: int | None = None
        self.position = 0  # the position the next decode step writes for it: the tokens in its cache
        self.prefilling = False  # its prompt is going in by chunks: the decode steps leave it out
        self.filled = 0  # while prefilling, the positions in its cache
        self.admitted = 0  # the order it was (last) admitted in: the last admitted gives its blocks back first
        self.ids: list[int] = []
        self.texts: list[str] = []
        self.pieces: list[str] = []
        self.stream = None if tokenizer is None else TextStream(tokenizer, request.prompt_ids, self.pieces.append)
        self.stops = StopStrings(request.stop_texts)
        self.cancelled = False  # set from any thread
        self.done = False
        self.started = time.perf_counter()
        self.first_token_at: float | None = None

    @property
    def sequence(self) -> tuple[int, ...]:
        """What its cache must hold before it decodes: its prompt and the tokens it has generated so far."""
        return (*self.request.prompt_ids, *self.ids)

    def accept(self, token: int, logprob: TokenLogprob | None) -> str | None:
        """Take the next token and tell of it; the finish reason once the request has ended (the caller frees its
        slot, then calls :meth:`finish`, so that whoever hears of the end finds the slot free)."""
        self.ids.append(token)
        self.first_token_at = self.first_token_at or time.perf_counter()
        stop_token = token in self.stop_ids
        complete = self.matcher is not None and self.matcher.finished  # nothing may follow but a stop token
        ending = stop_token or complete or len(self.ids) == self.request.max_new_tokens
        if self.stream is not None:
            if not stop_token:
                self.stream.push(token)
            if ending:
                self.stream.flush()
        text = self.stops.push("".join(self.pieces))
        self.pieces.clear()
        if ending and not self.stops.stopped:
            text += self.stops.flush()
        self.texts.append(text)
        self.on_event(Delta(token, text, logprob))
        if self.stops.stopped or ending:
            self.done = True
            return "stop" if self.stops.stopped or stop_token or complete else "length"
        return None

    def finish(self, reason: str) -> None:
        self.done = True
        ttft = None if self.first_token_at is None else self.first_token_at - self.started
        seconds = time.perf_counter() - self.started
        prompt_tokens = len(self.request.prompt_ids)
        self.on_event(Finished(reason, prompt_tokens, tuple(self.ids), "".join(self.texts), ttft, seconds))


class Batcher:
    """Requests decoded together in the slots of ``model``'s cache (see the module's docstring)."""

    def __init__(
        self,
        model: Transformer,
        steps: SlotSteps,
        options: BatchOptions,
        *,
        tokenizer: Decoder | None = None,
        stop_ids: Sequence[int] = (),
        compile_constraint: Callable[[OutputConstraint], Matcher] | None = None,
    ) -> None:
        block_size = model.config.block_size
        if options.max_seq_length is not None and options.max_seq_length > block_size:
            message = f"max_seq_length {options.max_seq_length} exceeds the model's context of {block_size}"
            raise OptionError(message, "max_seq_length")
        self.model, self.steps, self.options = model, steps, options
        self.step_rows = step_rows(options, steps.mode != "none")  # the decode step's row counts, ascending
        self.tokenizer, self.stop_ids = tokenizer, tuple(stop_ids)
        self.compile_constraint = compile_constraint  # a constraint's matcher (None: no constraint can be served)
        self.host_masks: torch.Tensor | None = None  # [N, W]: the constrained slots' next masks, made on first use
        self.max_seq_length = options.max_seq_length or block_size
        self.device = model.norm.weight.device
        self.allocator: BlockAllocator | None = None  # None: a static cache, a row per slot
        rows = options.max_batch  # the slots, then (paged) the rows that prompts are prefilled in together
        if options.kv_cache == "static":
            self.block_size = self.max_seq_length
            model.setup_caches(rows, self.max_seq_length)
        else:
            self.block_size, rows = options.block_size, rows + PREFILL_ROWS
            blocks = cache_blocks(model, options, self.max_seq_length)
            model.setup_caches(rows, self.max_seq_length, blocks=blocks, block_size=self.block_size)
            model.block_table.blocks.zero_()  # no row keeps blocks of an earlier batcher's requests
            self.allocator = BlockAllocator(blocks, self.block_size)
        self.tables: list[list[int]] = [[] for _ in range(options.max_batch)]  # each slot's blocks, in order
        self.admissions = self.preemptions = self.prefix_queried = self.prefix_hit = self.blocks_peak = 0
        self.state = SlotState(rows, model.config.vocab_size, self.device)
        self.row_prefills = None  # prompts prefilled together (paged): in the rows after the slots
        if self.allocator is not None:
            graphs = steps.graphs and self.device.type == "cuda"
            self.row_prefills = RowPrefills(model, self.state, options.max_batch, graphs)
        self.slots: list[Job | None] = [None] * options.max_batch
        self.waiting: deque[Job] = deque()
        self.readbacks = Readbacks(self.device)  # the steps launched and not handed out yet
        self.lock = threading.Condition(threading.RLock())  # reentrant: close() may run in a signal handler
        self.closed = False
        self.tokens_generated = 0

    # --- any thread ---------------------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise ValueError if ``request`` cannot be served."""
        prompt, budget, vocab = request.prompt_ids, request.max_new_tokens, self.model.config.vocab_size
        if not prompt:
            raise ValueError("the prompt is empty")
        require_int(budget, "max_new_tokens", 0 if request.prompt_logprobs is not None else 1)
        if len(prompt) + budget > self.max_seq_length:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({budget}) = {len(prompt) + budget} exceeds the "
                f"context of {self.max_seq_length} tokens"
            )
        ids = (*prompt, *request.stop_ids, *(token for token, _ in request.adjust.logit_bias))
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be integers in 0..{vocab - 1}")
        for name in ("top_logprobs", "prompt_logprobs"):
            if getattr(request, name) is not None:
                require_int(getattr(request, name), name, 0, min(TOP_LOGPROBS, vocab))
        if len(request.stop_texts) > MAX_STOP_TEXTS or not all(request.stop_texts):
            raise ValueError(f"stop strings must be non-empty, {MAX_STOP_TEXTS} at most")
        if request.constraint is not None and self.compile_constraint is None:
            raise ValueError("this model cannot hold an answer to a constraint (it has no tokenizer)")

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Job:
        """Queue ``request``; its events go to ``on_event``. ValueError for a request that cannot be served (a
        constraint the grammar engine refuses: GrammarError), QueueFull when every slot is busy and the queue full.
        The constraint is compiled here, in the caller's thread."""
        self.check(request)
        matcher = None if request.constraint is None else self.compile_constraint(request.constraint)
        job = Job(request, on_event, self.tokenizer, self.stop_ids, matcher)
        with self.lock:
            if self.closed:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) + self.busy >= self.options.max_batch + self.options.max_queue:
                raise QueueFull(f"all {self.options.max_batch} slots are busy and {len(self.waiting)} requests wait")
            self.waiting.append(job)
            self.lock.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Stop ``job`` (if it has not finished): its slot is freed at the next step."""
        job.cancelled = True
        with self.lock:
            self.lock.notify()

    def close(self) -> None:
        """Make :meth:`serve_forever` return (after the step in progress) and refuse new requests. Safe from any
        thread, and from a signal handler of the serving thread (the lock is reentrant)."""
        with self.lock:
            self.closed = True
            self.lock.notify()

    @property
    def busy(self) -> int:
        """Slots holding a request."""
        return sum(job is not None for job in self.slots)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self.waiting)

    def cache_usage(self) -> CacheUsage:
        """The cache's use now (read from any thread: a snapshot of counters the driving thread updates)."""
        allocator = self.allocator
        hits = (self.prefix_queried, self.prefix_hit, self.preemptions)
        blocks = self.options.max_batch if allocator is None else allocator.capacity
        return CacheUsage(self.block_size, blocks, self.blocks_in_use(), self.blocks_peak, *hits)

    def blocks_in_use(self) -> int:
        """Blocks held by the requests in the slots (a static cache: its rows)."""
        return self.busy if self.allocator is None else self.allocator.used

    def reset_peak(self) -> None:
        """Count :attr:`CacheUsage.blocks_peak` from now on (a benchmark's run: exact, where readings of
        ``blocks_used`` between steps can miss a short run's blocks)."""
        self.blocks_peak = 0

    # --- the driving thread -------------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Step whenever there is work, until :meth:`close`. A step that fails fails the requests in the slots (each
        gets a Failed event) and the server goes on with the next ones. However it ends (an exception such as
        KeyboardInterrupt included), the requests not yet finished fail, and later ones are refused."""
        try:
            while True:
                with self.lock:
                    while not self.closed and not self.has_work():
                        self.lock.wait()
                    if self.closed:
                        break
                try:
                    self.step()
                except Exception as err:  # whatever broke a step, the server stays up
                    traceback.print_exc(file=sys.stderr)
                    self._fail_busy(f"generation failed: {type(err).__name__}: {err}")
        finally:
            self.close()
            self._fail_all("the server is shutting down")

    def serve_while(
        self, clients: Callable[[], object], *, stop: Callable[[], None] | None = None, timeout: float | None = None
    ) -> None:
        """Serve in this thread (the one that compiled and warmed up the steps: see the module's docstring) while
        ``clients`` runs in a thread of its own, submitting requests. Serving ends with :meth:`close`: when
        ``clients`` returns or raises, or when anything else closes the batcher (a signal handler of this thread).
        Then ``stop`` (if given) tells the clients' thread to end, which is waited for up to ``timeout`` seconds.
        An error of ``clients`` is raised here."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                clients()
            except BaseException as err:  # raised again in the serving thread
                errors.append(err)
            finally:
                self.close()

        thread = threading.Thread(target=run, name="gpt-fast-clients", daemon=True)
        thread.start()
        try:
            self.serve_forever()
        finally:
            if stop is not None:
                stop()
            thread.join(timeout)
        if errors:
            raise errors[0]

    def run(self) -> None:
        """Run the decode loop until every submitted request has finished."""
        for _ in run_steps(self, self.readbacks):
            pass

    def has_work(self) -> bool:
        return not self.finished() or self.readbacks.pending > 0

    @torch.no_grad()
    def step(self) -> None:
        """One turn of the decode loop (:func:`gpt_fast.generation.loop.turn`): launch a step (:meth:`launch`) if
        fewer than :data:`IN_FLIGHT_STEPS` are in flight, else wait for the oldest; then hand out the tokens that
        have arrived."""
        for _ in turn(self, self.readbacks):
            pass

    # --- the batcher as the loop's step producer ----------------------------------------------------------------

    def can_launch(self, pending: int) -> bool:
        """Fewer than :data:`IN_FLIGHT_STEPS` steps in flight, and a step would do something: give a request a token
        (not while every busy slot is a constrained one waiting for its mask), free a cancelled one, or admit one."""
        if pending >= IN_FLIGHT_STEPS:
            return False
        busy = [job for job in self.slots if job is not None]
        admits = bool(self.waiting) and len(busy) < len(self.slots)
        return admits or any(not job.awaiting or job.cancelled or job.prefilling for job in busy)

    def launch(self, readbacks: Readbacks) -> None:
        """Free the slots of cancelled requests, prefill waiting requests into free slots, and launch one decode
        step of the busy slots: the masked one while a constrained request is in them."""
        self._drop_cancelled()
        self._admit()
        self._continue_prefill()
        self._ensure_blocks()
        self.blocks_peak = max(self.blocks_peak, self.blocks_in_use())
        rows = self._rows()
        if not rows:
            return
        owners = self.slots[:rows]
        masked = any(job is not None and job.matcher is not None for job in owners)
        held = self._set_masks(owners) if masked else frozenset()
        held |= {row for row, job in enumerate(owners) if job is not None and job.prefilling}  # they take no token
        cudagraph_step_begin()
        self.steps.decode(self.model, self.state, rows, **masked_step(masked))
        self._read_back(0, rows, held)
        for row, job in enumerate(owners):
            if job is not None and row not in held:
                job.position += 1

    def _set_masks(self, owners: Sequence[Job | None]) -> frozenset[int]:
        """Before a masked step: each constrained slot's new mask into the state, and the rows to hold (a
        constrained slot whose last token has not been handed out yet). The copies come from pageable host memory,
        which the driver stages at once: the host may write it again without waiting for the device."""
        held = frozenset(row for row, job in enumerate(owners) if job is not None and job.awaiting)
        for job in owners:
            if job is not None and job.matcher is not None and not job.awaiting and not job.prefilling:
                self._load_mask(job)
                job.awaiting = True
        hold = torch.tensor([row in held for row in range(len(owners))])
        self.state.hold[: len(owners)].copy_(hold, non_blocking=True)
        return held

    def _load_mask(self, job: Job) -> None:
        """Copy the constrained ``job``'s next mask, on the host, into its slot's state (once)."""
        if job.mask_stale:
            self.state.allowed[job.slot].copy_(self.host_masks[job.slot], non_blocking=True)
            job.mask_stale = False

    def deliver(self, record: Record) -> Iterator[None]:
        """Give each request its token of a step (its events go to its callback): nothing is yielded. A constrained
        request's matcher takes the token and makes the next mask; one the grammar engine gives up on fails."""
        owners, with_logprobs, held = record.tag
        tokens = record.host[0][: len(owners)].tolist()
        for row, job in enumerate(owners):
            if job is None or job.done or job.cancelled or row in held:
                continue
            logprob = self._logprob(record, row, job) if with_logprobs else None
            self.tokens_generated += 1
            try:
                self._advance(job, tokens[row])
            except GrammarError as err:
                self._free(job)
                job.done = True
                job.on_event(Failed(str(err), 400))
                continue
            reason = job.accept(tokens[row], logprob)
            if reason is not None:
                self._free(job)
                job.finish(reason)
        yield from ()

    def _advance(self, job: Job, token: int) -> None:
        """A constrained request's matcher takes ``token``; its next mask is made on the host."""
        if job.matcher is None:
            return
        job.matcher.advance(token)
        job.awaiting = False
        if not job.matcher.finished:
            self._fill_mask(job)

    def finished(self) -> bool:
        return not self.waiting and self.busy == 0

    @torch.no_grad()
    def warm_up(self, constrained: bool = False) -> None:
        """Compile (and, in the CUDA-graph modes, capture) the steps before the first request: a short prefill and
        every decode step size, three times (a CUDA graph is recorded on a later call than the first); with
        ``constrained``, their masked forms too (else they are compiled when the first constrained request comes).
        Then the eager extension of a prompt (a prefix cache hit, a prefill chunk) once, whose first call on a GPU
        would otherwise delay a request's first token, and with a paged cache in the CUDA-graph modes, the prefill of
        several prompts in each of its shapes (:meth:`~gpt_fast.generation.slots.RowPrefills.warm_up`). Every slot
        is left free, at position 0."""
        prompt = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        for masked in (False, True) if constrained else (False,):
            for _ in range(3):
                self.steps.prefill(self.model, self.state, 0, prompt, **masked_step(masked))
                for rows in self.step_rows:
                    cudagraph_step_begin()
                    self.steps.decode(self.model, self.state, rows, **masked_step(masked))
        extend_slot(self.model, self.state, 0, prompt[:, 1:], torch.ones(1, dtype=torch.long, device=self.device))
        if self.row_prefills is not None:
            self.row_prefills.warm_up()
        self.state.live.fill_(False)
        self.state.input_pos.zero_()
        device_synchronize(self.device)

    def _rows(self) -> int:
        """Slots the decode step runs: the fewest of its row counts (:attr:`step_rows`) that hold every busy slot
        (none if idle)."""
        last = max((slot for slot, job in enumerate(self.slots) if job is not None), default=-1)
        if last < 0:
            return 0
        return next(rows for rows in self.step_rows if rows > last)

    def _drop_cancelled(self) -> None:
        for job in self.slots:
            if job is not None and job.cancelled:
                self._free(job)
                job.finish("cancelled")
        with self.lock:
            cancelled = [job for job in self.waiting if job.cancelled]
            for job in cancelled:
                self.waiting.remove(job)
        for job in cancelled:
            job.finish("cancelled")

    def _admit(self) -> None:
        """Prefill waiting requests into free slots, lowest first, while the cache has the blocks their prompts need
        (the first waiting request that does not fit waits, and the ones behind it). A prompt's first full blocks
        come from the prefix cache when they are there; a resumed request prefills its prompt and its tokens so
        far. With a paged cache, the prompts admitted together go in together (:meth:`_prefill_together`), but for
        a constrained request's, a scored one's and one longer than a prefill of several takes, which go alone.
        Prompts are scored where asked: a request with no new tokens to generate then ends here."""
        together: list[Job] = []
        while None in self.slots:
            with self.lock:
                if not self.waiting:
                    break
                job = self.waiting[0]
            tokens = job.sequence
            if together and self._shares_uncached_blocks(tokens, together):
                self._prefill_together(together)  # their blocks join the prefix cache first
                together = []
            slot = self.slots.index(None)
            reused = self._take_blocks(job, slot, tokens)
            if reused is None:
                break
            with self.lock:
                self.waiting.popleft()
            job.slot, self.slots[slot] = slot, job
            self.admissions += 1
            job.admitted, job.position, job.filled = self.admissions, len(tokens), reused
            chunk = self.options.prefill_chunk
            if chunk is not None and len(tokens) - reused > chunk and job.request.prompt_logprobs is None:
                job.prefilling = True  # its prompt goes in by chunks, one per launch (_continue_prefill)
                self.state.input_pos[slot] = self.max_seq_length - 1  # the decode steps meanwhile write past it
                continue
            if self._goes_together([job]) and job.matcher is None and job.request.prompt_logprobs is None:
                together.append(job)
                continue
            self._prefill(job, tokens, reused)
            self._prefilled(job, tokens)
        self._prefill_together(together)

    def _shares_uncached_blocks(self, tokens: Sequence[int], pending: Sequence[Job]) -> bool:
        """Whether ``tokens`` start with more full blocks of a ``pending`` prompt (admitted, not yet prefilled) than
        the prefix cache holds of them: then the pending prompts go in first, and their blocks serve these tokens."""
        size, reusable = self.block_size, (len(tokens) - 1) // self.block_size
        cached = len(self.allocator.find(tokens[: reusable * size]))
        if reusable == cached:
            return False
        end = (cached + 1) * size  # the first block the cache does not hold
        return any(tuple(job.sequence[:end]) == tuple(tokens[:end]) for job in pending)

    def _goes_together(self, jobs: Sequence[Job]) -> bool:
        """Whether one prefill of several prompts (:class:`~gpt_fast.generation.slots.RowPrefills`) takes the rest
        of ``jobs``' prompts (each from its first token not in the cache), within the cache's length."""
        if self.row_prefills is None:
            return False
        shape = prefill_shape(len(jobs), max(len(job.sequence) - job.filled for job in jobs))
        return shape is not None and all(job.filled + shape[1] <= self.max_seq_length for job in jobs)

    def _prefill_together(self, jobs: Sequence[Job]) -> None:
        """Prefill ``jobs`` (admitted, their blocks taken) in as few prefills of several prompts as take them, in
        order, each sampling its prompts' first tokens."""
        group: list[Job] = []
        for job in jobs:
            if group and not self._goes_together([*group, job]):
                self._prefill_group(group)
                group = []
            group.append(job)
        if group:
            self._prefill_group(group)

    def _prefill_group(self, jobs: Sequence[Job]) -> None:
        """One prefill of ``jobs``' prompts in the rows after the slots, whose state then moves to their slots."""
        first = self.options.max_batch
        for row, job in enumerate(jobs, first):
            self._configure(job, row, torch.tensor(job.sequence, device=self.device))
        tables = [self.tables[job.slot] for job in jobs]
        self._write_rows(first, tables + [[]] * (PREFILL_ROWS - len(jobs)))  # the rows past the prompts: the sink
        self.row_prefills([RowPrefill(job.sequence[job.filled :], job.filled) for job in jobs])
        move_rows(self.state, first, torch.tensor([job.slot for job in jobs], device=self.device))
        for job in jobs:
            self._prefilled(job, job.sequence)

    def _prefilled(self, job: Job, tokens: Sequence[int]) -> None:
        """After the last of ``job``'s prompt is in its cache and its first token sampled: its full blocks join the
        prefix cache, and the token is read back (a request that only scores its prompt ends)."""
        if self.allocator is not None:
            self.allocator.register(self.tables[job.slot], tokens)
        if job.request.max_new_tokens == 0:
            self._free(job)
            job.finish("length")
        else:
            self._read_back(job.slot, 1)

    @torch.no_grad()
    def _continue_prefill(self) -> None:
        """The next chunk of ``prefill_chunk`` tokens of one request whose prompt goes in by chunks (the lowest
        slot's), before a decode step of the others; the last chunk samples its first token, and it decodes from
        the next step on."""
        job = next((job for job in self.slots if job is not None and job.prefilling), None)
        if job is None:
            return
        tokens = job.sequence
        end = job.filled + self.options.prefill_chunk
        if end >= len(tokens):
            job.prefilling = False
            self._prefill(job, tokens, job.filled)
            self._prefilled(job, tokens)
            return
        ids = torch.tensor([tokens[job.filled : end]], dtype=torch.long, device=self.device)  # [1, C]
        positions = torch.arange(job.filled, end, device=self.device)
        self.model(ids, positions, last_only=True, first_row=job.slot, from_start=job.filled == 0)
        job.filled = end

    def _take_blocks(self, job: Job, slot: int, tokens: Sequence[int]) -> int | None:
        """Give ``slot`` the blocks for ``tokens``: those of its first full blocks the prefix cache holds, and new
        ones for the rest; the tokens found computed, or None (nothing taken) while the cache has too few blocks
        free (one more than the prompt needs while other requests run, so that they may grow)."""
        size, allocator = self.block_size, self.allocator
        if allocator is None:  # a static cache: the slot's row
            return 0
        resumed, scored = bool(job.ids), job.request.prompt_logprobs is not None
        reusable = 0 if scored else (len(tokens) - 1) // size * size  # the last token is always computed
        found = allocator.lookup(tokens[:reusable])
        needed = -(-len(tokens) // size) - len(found)
        if allocator.available < needed + (1 if self.busy else 0):
            allocator.release(found)
            return None
        self.tables[slot] = [*found, *(allocator.allocate() for _ in range(needed))]
        self._write_table(slot)
        if not resumed:
            self.prefix_queried += len(tokens)
            self.prefix_hit += len(found) * size
        return len(found) * size

    def _prefill(self, job: Job, tokens: Sequence[int], reused: int) -> None:
        """Prefill ``job``'s slot with ``tokens`` (its prompt, and its answer so far when resumed), from position
        ``reused`` on (the ones before are in its blocks already), and sample its next token."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        self._configure(job, job.slot, ids[0])
        masked = job.matcher is not None
        if masked:
            self._fill_mask(job)
            self._load_mask(job)
            job.awaiting = True
        if job.request.prompt_logprobs is not None and not job.ids:
            self._score(job, ids, masked)
        elif reused:
            positions = torch.arange(reused, len(tokens), device=self.device)
            extend_slot(self.model, self.state, job.slot, ids[:, reused:], positions, masked)
        else:
            self.steps.prefill(self.model, self.state, job.slot, ids, **masked_step(masked))

    def _configure(self, job: Job, row: int, ids: torch.Tensor) -> None:
        """Set ``job``'s sampling settings and adjustments in the state's ``row``, from its tokens ``ids`` [T] on
        the device: its prompt, and its answer so far when resumed."""
        prompt_length = len(job.request.prompt_ids)
        answer = ids[prompt_length:] if job.ids else None
        request = job.request
        scored = request.top_logprobs is not None
        self.state.configure(row, request.sampling, job.key, request.adjust, ids[:prompt_length], answer, scored)

    def _ensure_blocks(self) -> None:
        """Before a decode step: every busy slot holds the block the step writes its next position to (positions
        past the request's last one need none: they go to the sink). When no block is left, requests give theirs
        back, the last admitted first (:meth:`_preempt`)."""
        size = self.block_size
        for slot, job in enumerate(self.slots if self.allocator is not None else ()):
            last = 0 if job is None else len(job.request.prompt_ids) + job.request.max_new_tokens - 2
            while (
                job is not None
                and not job.prefilling
                and self.slots[slot] is job
                and job.position // size >= len(self.tables[slot])
            ):
                if job.position > last:
                    break
                block = self.allocator.allocate()
                if block is None:
                    self._preempt()
                    continue
                self.tables[slot].append(block)
                self._write_table(slot)

    def _preempt(self) -> None:
        """Free blocks: first hand out every step in flight (requests may finish); if none is free then, the
        request admitted last leaves its slot and its blocks and waits at the head of the queue, to be resumed."""
        for record in self.readbacks.ready(keep=0):
            for _ in self.deliver(record):
                pass
        if self.allocator.available:
            return
        victim = max((job for job in self.slots if job is not None), key=lambda job: job.admitted)
        self._free(victim)
        victim.slot, victim.awaiting, victim.prefilling = None, False, False
        self.preemptions += 1
        with self.lock:
            self.waiting.appendleft(victim)

    def _write_table(self, slot: int) -> None:
        """Copy ``slot``'s blocks into its row of the device's block table (:meth:`_write_rows`)."""
        self._write_rows(slot, [self.tables[slot]])

    def _write_rows(self, first: int, tables: Sequence[Sequence[int]]) -> None:
        """Copy ``tables`` (each a row's blocks) into the device's block table from row ``first`` on, block 0 (the
        sink) past each row's blocks. From pageable host memory, staged at once: the steps in flight read the rows
        as they were when they were launched."""
        rows = self.model.block_table.blocks[first : first + len(tables)]  # [n, W]
        width = rows.shape[1]
        rows.copy_(torch.tensor([[*blocks, *[0] * (width - len(blocks))] for blocks in tables]), non_blocking=True)

    def _fill_mask(self, job: Job) -> None:
        """The constrained ``job``'s next mask, on the host."""
        if self.host_masks is None:
            self.host_masks = torch.empty(self.state.allowed.shape, dtype=torch.int32)
        job.matcher.fill(self.host_masks[job.slot])
        job.mask_stale = True

    @torch.no_grad()
    def _score(self, job: Job, prompt: torch.Tensor, masked: bool) -> None:
        """Prefill ``job``'s slot with its prompt [1, T] scored, and tell the job its prompt's log-probabilities.
        The host waits for them: scoring is for evaluation, not for the latency of the other slots."""
        count, ids = job.request.prompt_logprobs, job.request.prompt_ids
        scored = score_slot(self.model, self.state, job.slot, prompt, count, masked)
        chosen, best, best_ids = (t.tolist() for t in scored)
        items = [TokenLogprob(ids[0], self._token_text(ids[0]), None, ())]
        for token, logprob, top, top_ids in zip(ids[1:], chosen, best, best_ids, strict=True):
            alternatives = tuple((t, self._token_text(t), lp) for t, lp in zip(top_ids, top, strict=True))
            items.append(TokenLogprob(token, self._token_text(token), logprob, alternatives))
        job.on_event(PromptLogprobs(tuple(items)))

    def _free(self, job: Job) -> None:
        """``job`` leaves its slot and lets go of its blocks."""
        if job.slot is not None and self.slots[job.slot] is job:
            self.slots[job.slot] = None
            self.state.live[job.slot], self.state.input_pos[job.slot] = False, 0  # its attention reads one position
            if self.allocator is None:
                return
            self.allocator.release(self.tables[job.slot])
            self.tables[job.slot] = []
            self._write_table(job.slot)

    def _read_back(self, first_row: int, rows: int, held: frozenset[int] = frozenset()) -> None:
        """Queue the copies of a step's results for slots ``first_row`` onwards to host memory; the ``held`` rows
        took no token in it."""
        owners = tuple(self.slots[first_row : first_row + rows])
        with_logprobs = any(job is not None and job.request.top_logprobs is not None for job in owners)
        state, end = self.state, first_row + rows
        results = (state.tokens, state.logprobs, state.top_ids) if with_logprobs else (state.tokens,)
        self.readbacks.push([t[first_row:end] for t in results], (owners, with_logprobs, held))

    def _logprob(self, record: Record, row: int, job: Job) -> TokenLogprob | None:
        count = job.request.top_logprobs
        if count is None:
            return None
        token = int(record.host[0][row])
        logprobs = record.host[1][row].tolist()
        top_ids = record.host[2][row, :count].tolist()
        top = tuple((t, self._token_text(t), lp) for t, lp in zip(top_ids, logprobs[1 : 1 + count], strict=True))
        return TokenLogprob(token, self._token_text(token), logprobs[0], top)

    def _token_text(self, token: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token])

    def _fail_busy(self, message: str) -> None:
        """After a failed step: every request in a slot fails, and the results in flight are dropped."""
        self.readbacks.clear()
        for job in self.slots:
            if job is not None:
                self._free(job)
                job.done = True
                job.on_event(Failed(message))

    def _fail_all(self, message: str) -> None:
        with self.lock:
            waiting, self.waiting = list(self.waiting), deque()
        self._fail_busy(message)
        for job in waiting:
            job.done = True
            job.on_event(Failed(message))


def cache_blocks(model: Transformer, options: BatchOptions, max_seq_length: int) -> int:
    """The paged cache's blocks, the sink included (:class:`BatchOptions`): enough for ``max_batch`` sequences of
    ``max_seq_length`` tokens, or ``kv_cache_tokens``, or what ``kv_cache_memory`` holds, which must be at least one
    such sequence."""
    size, memory, tokens = options.block_size, options.kv_cache_memory, options.kv_cache_tokens
    per_sequence = -(-max_seq_length // size)
    if tokens is not None:
        if tokens < max_seq_length:
            message = f"kv_cache_tokens {tokens} cannot hold one sequence of max_seq_length {max_seq_length}"
            raise OptionError(message, "kv_cache_tokens")
        return -(-tokens // size) + 1
    if memory is None:
        return options.max_batch * per_sequence + 1
    cfg, weight = model.config, model.norm.weight
    block_bytes = 2 * cfg.n_layer * cfg.n_local_heads * size * cfg.head_dim * model.kv_dtype.itemsize
    budget = memory * 2**30 if memory > 1 else memory * device_free_bytes(weight.device)
    blocks = int(budget // block_bytes)
    if blocks < per_sequence + 1:
        message = (
            f"kv_cache_memory {memory} holds {blocks} blocks of {size} tokens ({block_bytes} bytes each); one "
            f"sequence of max_seq_length {max_seq_length} needs {per_sequence + 1}"
        )
        raise OptionError(message, "kv_cache_memory")
    return blocks
