"""The one decode loop: launch steps ahead of the host, read their results back by event, stop on the host.

Every way of generating runs on :func:`run_steps`: plain decoding (:class:`gpt_fast.generation.decode.PlainSteps`),
speculative rounds (:class:`gpt_fast.generation.speculative.SpeculativeRounds`) and the batcher's slots
(:class:`gpt_fast.engine.batcher.Batcher`, over :class:`gpt_fast.generation.slots.SlotSteps`). A *step producer*
launches work on the device and names the tensors it wants back; the loop copies them to pinned host memory behind
an event (:class:`Readbacks`), launches the next step while the device runs, and hands each step's results to the
producer once the device has written them, a step or two behind. The host never waits for the step it has just
launched; it waits only when the producer may not run further ahead.

For one request's rows (plain and speculative decoding), :func:`decode_rows` is the consumer on top: the token
budget, stop tokens per row, the time to the first token and the :class:`GenerationResult`.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gpt_fast.generation.profiling import PREFILL_MARK
from gpt_fast.util.device import device_synchronize

Mark = Callable[[str], contextlib.AbstractContextManager]
TokenCallback = Callable[[list[int]], None]  # receives one decoded token per batch row, in order
BUFFER_CHUNK = 64  # host buffers are pinned this many records at a time: one allocation, not one per step


def profile_mark(enabled: bool) -> Mark:
    """The profiler's named range around a step with ``enabled`` (``gpt-fast trace-summary`` reads them), else none."""
    return torch.profiler.record_function if enabled else (lambda _name: contextlib.nullcontext())


def prompt_rows(prompt_ids: Sequence[int], batch_size: int, device: torch.device) -> torch.Tensor:
    """The prompt for every row [B, T], built on the host and copied once (no ``repeat`` on the device)."""
    return torch.tensor([list(prompt_ids)] * batch_size, dtype=torch.long).to(device)


@dataclass
class Record:
    """One launched step's results on their way to host memory: ``host`` holds them once :meth:`ready`."""

    host: tuple[torch.Tensor, ...]  # pinned copies, shaped as the device tensors pushed
    tag: Any  # what the producer needs to read them (the batcher: the slots' requests at launch)
    event: torch.cuda.Event | None  # recorded after the copies (None on the CPU: they are done)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class Readbacks:
    """The launched steps whose results are being copied to the host, oldest first, with their buffers recycled."""

    def __init__(self, device: torch.device) -> None:
        self.on_gpu = device.type == "cuda"
        self.queue: deque[Record] = deque()
        self.spare: dict[tuple[tuple[torch.Size, torch.dtype], ...], list[tuple[torch.Tensor, ...]]] = {}

    def push(self, tensors: Sequence[torch.Tensor], tag: Any = None) -> None:
        """Queue copies of ``tensors`` from the device, after everything launched so far."""
        shapes = tuple((t.shape, t.dtype) for t in tensors)
        spare = self.spare.get(shapes)
        if not spare:
            spare = self.spare.setdefault(shapes, [])
            spare.extend(self._buffers(tensors))
        host = spare.pop()
        for dst, src in zip(host, tensors, strict=True):
            dst.copy_(src, non_blocking=self.on_gpu)
        event = torch.cuda.Event() if self.on_gpu else None
        if event is not None:
            event.record()
        self.queue.append(Record(host, tag, event))

    def _buffers(self, tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
        """Host buffers for :data:`BUFFER_CHUNK` records of ``tensors``' shapes, one pinned allocation per tensor."""
        blocks = [torch.empty((BUFFER_CHUNK, *t.shape), dtype=t.dtype, pin_memory=self.on_gpu) for t in tensors]
        return [tuple(block[i] for block in blocks) for i in range(BUFFER_CHUNK)]

    @property
    def pending(self) -> int:
        """Steps queued and not handed out yet."""
        return len(self.queue)

    def ready(self, keep: int | None = None) -> Iterator[Record]:
        """The records whose copies have arrived, oldest first; with ``keep``, first waiting for all but the newest
        ``keep`` (``keep=0``: all). A record's buffers are reused once the next one is asked for."""
        while self.queue:
            record = self.queue[0]
            if keep is not None and len(self.queue) > keep:
                record.wait()
            elif not record.ready():
                return
            self.queue.popleft()
            yield record
            self.spare.setdefault(tuple((t.shape, t.dtype) for t in record.host), []).append(record.host)

    def wait_oldest(self) -> None:
        """Block until the oldest pending record has arrived (the later ones may still be running)."""
        self.queue[0].wait()

    def clear(self) -> None:
        """Drop every record in flight (after a failed step)."""
        self.queue.clear()


class StepProducer(Protocol):
    """What :func:`run_steps` drives: it launches steps and reads what they wrote."""

    def can_launch(self, pending: int) -> bool:
        """Whether one more step may be launched while ``pending`` steps' results have not been handed out."""

    def launch(self, readbacks: Readbacks) -> None:
        """Launch one step on the device and push the tensors its results are read from."""

    def deliver(self, record: Record) -> Iterator[Any]:
        """Read one step's results (once on the host) and yield what they give the consumer."""

    def finished(self) -> bool:
        """Whether nothing more is to be launched or read."""


def run_steps(producer: StepProducer, readbacks: Readbacks) -> Generator[Any, None, None]:
    """The loop: turn after turn (:func:`turn`) until the producer is finished and nothing is pending."""
    while not producer.finished() or readbacks.pending:
        yield from turn(producer, readbacks)


def turn(producer: StepProducer, readbacks: Readbacks) -> Generator[Any, None, None]:
    """One turn of the loop: launch a step if the producer may, else wait for the oldest pending one; then hand out
    every step whose results have arrived."""
    if not producer.finished() and producer.can_launch(readbacks.pending):
        producer.launch(readbacks)
    elif readbacks.pending:
        readbacks.wait_oldest()
    for record in readbacks.ready():
        yield from producer.deliver(record)


class StopTracker:
    """Which batch rows have emitted a stop token, and where."""

    def __init__(self, batch_size: int, stop_ids: Sequence[int]) -> None:
        self.stop_ids = frozenset(stop_ids)
        self.stopped_at: list[int | None] = [None] * batch_size
        self.steps_seen = 0

    def observe(self, step_tokens: list[int]) -> None:
        for row, token in enumerate(step_tokens):
            if self.stopped_at[row] is None and token in self.stop_ids:
                self.stopped_at[row] = self.steps_seen
        self.steps_seen += 1

    @property
    def all_stopped(self) -> bool:
        return all(s is not None for s in self.stopped_at)

    def cut(self, rows: list[list[int]]) -> list[list[int]]:
        """Each row's tokens up to and including its stop token."""
        return [row if end is None else row[: end + 1] for row, end in zip(rows, self.stopped_at, strict=True)]


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[list[int]]  # per batch row: the new tokens, up to and including a stop token
    seconds: float  # prefill + decode, wall time
    ttft_seconds: float  # time to the first new token

    @property
    def new_tokens(self) -> int:
        """New tokens per row (the longest row)."""
        return max(len(row) for row in self.tokens)


class RowSteps(Protocol):
    """A producer of one request's rows, which share one position: each step gives each row one or more tokens."""

    batch_size: int
    always_read: bool  # read every step back even when nobody watches (the step's token count varies)

    def prefill(self) -> None:
        """Run the prompt: the first new token is written."""

    def step(self) -> None:
        """Launch one step."""

    def latest(self) -> Sequence[torch.Tensor]:
        """The device tensors the latest prefill or step wrote its outcome to (what is read back)."""

    def may_run_ahead(self, pending: int, budget_left: int) -> bool:
        """Whether a step may be launched with ``pending`` steps unread and ``budget_left`` tokens still wanted."""

    def unpack(self, record: Record) -> list[list[int]]:
        """A step's new tokens, per position (one per row)."""

    def all_tokens(self, produced: int) -> list[list[int]]:
        """Per row, the first ``produced`` new tokens (read from the device, once it is done)."""

    def result(self, tokens: list[list[int]], seconds: float, ttft: float) -> GenerationResult:
        """The result of the generation (speculative decoding adds its figures)."""


class _RowConsumer:
    """:class:`StepProducer` over a :class:`RowSteps`: the token budget and the rows' stop tokens."""

    def __init__(self, steps: RowSteps, max_new_tokens: int, stops: StopTracker) -> None:
        self.steps, self.max_new_tokens, self.stops = steps, max_new_tokens, stops
        self.kept: list[list[int]] = []  # per position, as read back

    def can_launch(self, pending: int) -> bool:
        return self.steps.may_run_ahead(pending, self.max_new_tokens - len(self.kept))

    def launch(self, readbacks: Readbacks) -> None:
        self.steps.step()
        readbacks.push(self.steps.latest())

    def deliver(self, record: Record) -> Iterator[list[int]]:
        for step_tokens in self.steps.unpack(record):
            if self.finished():
                return
            self.stops.observe(step_tokens)
            self.kept.append(step_tokens)
            yield step_tokens

    def finished(self) -> bool:
        return len(self.kept) >= self.max_new_tokens or self.stops.all_stopped


@torch.no_grad()
def decode_rows(
    steps: RowSteps,
    device: torch.device,
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    emit: bool = True,
    profile_marks: bool = False,
) -> Generator[list[int], None, GenerationResult]:
    """Generate up to ``max_new_tokens`` per row with ``steps``; yields each position's tokens (one per row) once the
    device has produced them (with ``emit``), and returns the :class:`GenerationResult`. Rows stop once each has
    produced one of ``stop_ids``. With none, nobody watching (``emit`` off) and steps of one token each, nothing is
    read back until the end. ``profile_marks``: the prefill is a named range in a profiler trace."""
    mark = profile_mark(profile_marks)
    stops = StopTracker(steps.batch_size, stop_ids)
    watched = bool(stop_ids) or emit or steps.always_read
    device_synchronize(device)
    start = time.perf_counter()
    with mark(PREFILL_MARK):
        steps.prefill()
    device_synchronize(device)
    ttft = time.perf_counter() - start
    if not watched:
        for _ in range(max_new_tokens - 1):
            steps.step()
        device_synchronize(device)
        return steps.result(steps.all_tokens(max_new_tokens), time.perf_counter() - start, ttft)
    readbacks = Readbacks(device)
    readbacks.push(steps.latest())
    consumer = _RowConsumer(steps, max_new_tokens, stops)
    for step_tokens in run_steps(consumer, readbacks):
        if emit:
            yield step_tokens
    device_synchronize(device)
    seconds = time.perf_counter() - start
    rows = [list(row) for row in zip(*consumer.kept, strict=True)]
    return steps.result(stops.cut(rows), seconds, ttft)


def drain(stream: Generator[list[int], None, GenerationResult], on_tokens: TokenCallback | None) -> GenerationResult:
    """Run a generation stream to its end, handing each step's tokens to ``on_tokens``; its result."""
    while True:
        try:
            step_tokens = next(stream)
        except StopIteration as done:
            return done.value
        on_tokens(step_tokens)
