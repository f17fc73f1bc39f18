"""Speculative decoding measured against plain decoding on one engine, in one run, greedy, with the same prompt:
tokens/sec of each, the speed-up, whether the text is identical, acceptance and the cost of a round.

    # random weights of a shape: the mechanism's ceiling (replay), and a draft model of another shape
    gpt-fast bench speculative --shape llama-2-7b --draft_shape smollm2-135m --device cuda
    # a real checkpoint on a copy-heavy prompt: prompt lookup (and a draft checkpoint, if given)
    gpt-fast bench speculative --checkpoint_path CKPT --prompt_file prompts/rewrite_with_type_hints.txt \\
        --chat --prompt_lookup 3 --k 8

Rows: plain decoding; replay (the target's own greedy continuation, recorded first: every proposal is accepted
and drafting is free, so its speed-up is the ceiling of the mechanism, and its round costs a verify step over
k + 1 positions); prompt lookup; a draft model; and, with a draft model, replay at chosen agreement rates with the
draft model's steps run each round (its proposals unused), whose measured speed-up is set against the one
predicted from the acceptance rate and the draft model's measured round time.

With ``--batch_invariant`` the target runs batch-invariant steps (:mod:`gpt_fast.accel.invariant`), so that its
verify steps round as its decode steps do; a first row decodes with the usual kernels on a second engine over the
same weights, the speed-ups are over that fastest plain decoding, and each speculative row's text is compared with
plain decoding's on the same kernels.

Rates are of the decode phase: (new tokens - 1) / (time after the first token), median of ``--repeats`` runs after a
warm-up run that compiles.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt_fast.bench.options import SpeculativeBenchOptions
from gpt_fast.convert.random_init import random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.drafters import Drafter, DraftModel, PromptLookup, Replay
from gpt_fast.generation.metrics import SpeculativeMetrics
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.generation.speculative import MAX_ROUNDS_AHEAD, check_draft_config
from gpt_fast.model.shapes import get_shape
from gpt_fast.util.device import device_name, dtype_name, parse_dtype, resolve_device
from gpt_fast.util.fileio import write_text_atomic
from gpt_fast.util.settings import apply_torch_settings

GREEDY = SamplingConfig(temperature=0)
MAX_RECORDING_PASSES = 64  # replay recording: each pass extends the agreed prefix by at least one token


@dataclass(frozen=True)
class Row:
    name: str
    k: int | None
    tokens: list[int]  # the new tokens of the last timed run
    tokens_per_sec: float  # decode phase, median of the timed runs
    round_ms: float  # decode time per round (per token for plain decoding), wall, median
    speculative: SpeculativeMetrics | None  # over the timed runs
    agreement: float | None = None  # replay rows with spoiled proposals: the chance each is kept
    kernels: str = "usual"  # or "batch-invariant"


def decode_rate(result: object) -> tuple[float, float]:
    """Decode-phase tokens/sec of a result and its rounds' (or tokens') mean wall time in ms."""
    tokens = max(len(result.tokens[0]) - 1, 1)
    seconds = result.seconds - result.ttft_seconds
    spec = getattr(result, "speculative", None)
    steps = spec.rounds if spec is not None else tokens
    return tokens / seconds, 1e3 * seconds / steps


def measure(
    name: str,
    run: Callable[[], object],
    repeats: int,
    k: int | None = None,
    agreement: float | None = None,
    kernels: str = "usual",
) -> Row:
    run()  # warm-up: compiles
    results = [run() for _ in range(repeats)]
    rates = [decode_rate(r) for r in results]
    specs = [r.speculative for r in results if hasattr(r, "speculative")]
    return Row(
        name=name,
        k=k,
        tokens=results[-1].tokens[0],
        tokens_per_sec=statistics.median(rate for rate, _ in rates),
        round_ms=statistics.median(ms for _, ms in rates),
        speculative=SpeculativeMetrics.combined(specs) if specs else None,
        agreement=agreement,
        kernels=kernels,
    )


def expected_tokens_per_round(agreement: float, k: int) -> float:
    """Mean new tokens per round when each proposal is kept with probability ``agreement``, independently: the
    kept prefix plus the target's own token, (1 - a^(k+1)) / (1 - a)."""
    return k + 1.0 if agreement == 1 else (1 - agreement ** (k + 1)) / (1 - agreement)


@dataclass(frozen=True)
class Setup:
    """What the runs share: the target engine, the prompt, the request, and the drafters' makers."""

    engine: Engine
    prompt: list[int]
    new_tokens: int
    repeats: int
    ignore_eos: bool
    draft: Engine | None
    lookups: tuple[int, ...]
    agreements: tuple[float, ...]
    usual: Engine | None = None  # with a batch-invariant target: the same weights with the usual kernels

    @property
    def kernels(self) -> str:
        return "batch-invariant" if self.engine.options.batch_invariant else "usual"

    def generate(
        self, drafter: Drafter | None, tokens: int | None = None, engine: Engine | None = None
    ) -> Callable[[], object]:
        n, engine = tokens or self.new_tokens, engine or self.engine
        return lambda: engine.generate_ids(self.prompt, n, GREEDY, ignore_eos=self.ignore_eos, drafter=drafter)


def record_for_replay(setup: Setup, k: int) -> list[int]:
    """The target's greedy continuation as the timed replay computes it, for the replay drafter, recorded past the
    request's end: the host may start rounds beyond the last one it needs, and their proposals count too.

    Plain decoding's continuation is the first guess, from a request whose KV cache is as long as the timed
    speculative request's (both hold the same slack past the request). But a verify step over k + 1 positions may
    round differently from a one-position decode step (in bfloat16, without ``--batch_invariant``) and flip a near-tie,
    after which every replayed proposal is off. So the timed request itself is replayed and its output recorded until
    it produces what it proposes: each pass keeps the agreed prefix and extends it past at least one flip. Every pass
    is the timed request: a longer one would have a longer cache, and a token must not hang on that
    (``scripts/invariant_cache_length.py`` checks that it does not in the batch-invariant steps on a GPU)."""
    slack = (MAX_ROUNDS_AHEAD + 1) * (k + 1)
    recorded = setup.generate(None, setup.new_tokens + slack)().tokens[0]
    replay = Replay(setup.prompt + recorded, k)
    for _ in range(MAX_RECORDING_PASSES):
        produced = setup.generate(replay)().tokens[0]
        if produced == recorded[: len(produced)]:
            break
        recorded = produced + recorded[len(produced) :]  # past the request: the first guess, proposals only
        replay.sequence = setup.prompt + recorded  # read by the next run's setup, copied into the same buffer
    return recorded


def plain_rows(setup: Setup, write: Callable[[str], None]) -> list[Row]:
    """Plain decoding: with the usual kernels first (the speed-ups' baseline), then on the target's own if they
    differ."""
    rows = []
    if setup.usual is not None:
        rows.append(measure("plain decoding, usual kernels", setup.generate(None, engine=setup.usual), setup.repeats))
    name = "plain decoding" if setup.usual is None else f"plain decoding, {setup.kernels}"
    rows.append(measure(name, setup.generate(None), setup.repeats, kernels=setup.kernels))
    for row in rows:
        write(f"measured: {row.name}, {row.tokens_per_sec:.1f} tok/s")
    return rows


def run_rows(setup: Setup, ks: Sequence[int], write: Callable[[str], None]) -> list[Row]:
    rows = plain_rows(setup, write)
    for k in ks:
        recorded = record_for_replay(setup, k)
        write(f"measured: replay recording, k={k}")
        drafters: list[tuple[str, Drafter, float | None]] = [("replay", Replay(setup.prompt + recorded, k), None)]
        drafters += [(f"prompt lookup {n}", PromptLookup(n, k), None) for n in setup.lookups]
        if setup.draft is not None:
            draft_model = setup.draft.model
            drafters.append(("draft model", DraftModel(draft_model, k), None))
            for agreement in setup.agreements:
                replay = Replay(setup.prompt + recorded, k, agreement=agreement, cost=DraftModel(draft_model, k))
                drafters.append((f"replay {agreement:.0%} + draft steps", replay, agreement))
        for name, drafter, agreement in drafters:
            torch.manual_seed(0)
            rows.append(measure(name, setup.generate(drafter), setup.repeats, k, agreement, setup.kernels))
            write(f"measured: {name}, k={k}, {rows[-1].tokens_per_sec:.1f} tok/s")
    return rows


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _same_text(tokens: list[int], plain: list[int]) -> str:
    """ "yes", or "NO" with the index of the first new token that differs from plain decoding's."""
    if tokens == plain:
        return "yes"
    first = next(
        (i for i, (a, b) in enumerate(zip(tokens, plain, strict=False)) if a != b), min(len(tokens), len(plain))
    )
    return f"NO (from token {first})"


def plain_on(rows: list[Row], kernels: str) -> Row:
    """Plain decoding's row on ``kernels``."""
    return next(r for r in rows if r.k is None and r.kernels == kernels)


def table(rows: list[Row]) -> str:
    """One line per run: speed-up over the first (plain decoding with the usual kernels), identical text (against
    plain decoding on the same kernels; a second plain row against the first), acceptance, costs of a round."""
    plain = rows[0]
    lines = [
        "| run | k | tok/s | speed-up | identical text | acceptance | tokens/verify step | round (ms, wall) | "
        "round / decode step | draft (ms/round) | verify (ms/step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        spec = r.speculative
        same = "—" if r is plain else _same_text(r.tokens, (plain if r.k is None else plain_on(rows, r.kernels)).tokens)
        cells = [r.name, "—" if r.k is None else str(r.k), f"{r.tokens_per_sec:.1f}"]
        cells += [f"{r.tokens_per_sec / plain.tokens_per_sec:.2f}×", same]
        cells += ["—" if spec is None else f"{spec.acceptance_rate:.1%}"]
        cells += ["1.00" if spec is None else f"{spec.tokens_per_step:.2f}", _ms(r.round_ms)]
        cells += [f"{r.round_ms / plain.round_ms:.2f}×"]
        cells += [_ms(spec and spec.draft_ms_per_step), _ms(spec and spec.verify_ms_per_step)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def agreement_table(rows: list[Row]) -> str:
    """Replay at each agreement with the draft model's steps: tokens per round and speed-up, predicted from the
    agreement and the draft model's measured round time, against measured (speed-ups over plain decoding on the
    same kernels)."""
    plain = plain_on(rows, rows[-1].kernels)
    lines = [
        "| k | agreement | acceptance (measured) | tokens/verify step, predicted | measured | speed-up, predicted | "
        "measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        draft = next((d for d in rows if d.name == "draft model" and d.k == r.k), None)
        if r.agreement is None or draft is None:
            continue
        tokens = expected_tokens_per_round(r.agreement, r.k)
        predicted = tokens * plain.round_ms / draft.round_ms
        measured = r.tokens_per_sec / plain.tokens_per_sec
        cells = [str(r.k), f"{r.agreement:.0%}", f"{r.speculative.acceptance_rate:.1%}", f"{tokens:.2f}"]
        cells += [f"{r.speculative.tokens_per_step:.2f}", f"{predicted:.2f}×", f"{measured:.2f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def random_engines(shape_name: str, draft_shape: str | None, options: EngineOptions) -> tuple[Engine, Engine | None]:
    """The target of a named shape with random weights, and a draft of another shape given the target's vocabulary
    (random drafts of one shape share the byte-level tokenizer of random checkpoints)."""
    shape = get_shape(shape_name)
    device, dtype = options.device, parse_dtype(options.dtype)
    target = Engine.from_state(shape, random_weights(shape, dtype, seed=0, device=device), options)
    if draft_shape is None:
        return target, None
    draft_config = dataclasses.replace(get_shape(draft_shape), vocab_size=shape.vocab_size)
    return target, Engine.from_state(draft_config, random_weights(draft_config, dtype, seed=1, device=device), options)


def checkpoint_engines(checkpoint: str | None, draft: str | None, options: EngineOptions) -> tuple[Engine, Engine]:
    target = Engine.open(checkpoint, options)
    draft_engine = None
    if draft is not None:
        draft_engine = Engine.open(draft, options)
        check_draft_config(target.config, draft_engine.config, draft_engine.checkpoint_dir)
        draft_engine.load_weights()
    target.load_weights()
    return target, draft_engine


def usual_engine(engine: Engine, args: SpeculativeBenchOptions) -> Engine:
    """A second engine over the batch-invariant ``engine``'s weights (the same tensors) with the usual kernels."""
    options = dataclasses.replace(engine.options, batch_invariant=False)
    if args.shape is not None:
        return Engine.from_state(engine.model_config, engine.model.state_dict(), options)
    usual = Engine.open(engine.checkpoint_dir, options)
    usual.load_weights()
    return usual


def run(args: SpeculativeBenchOptions, write: Callable[[str], None] = print) -> list[Row]:
    """The benchmark of ``args`` (`gpt-fast bench speculative`): its rows, their tables written with ``write``."""
    device = str(resolve_device(args.device))
    options = EngineOptions(compile=args.mode, device=device, dtype=args.dtype, batch_invariant=args.batch_invariant)
    apply_torch_settings()
    if args.shape is not None:
        options = dataclasses.replace(options, dtype="bfloat16" if args.dtype == "auto" else args.dtype)
        engine, draft = random_engines(args.shape, args.draft_shape, options)
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, engine.model_config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
        what = f"{args.shape} (random weights)" + (f", draft {args.draft_shape}" if draft else "")
    else:
        engine, draft = checkpoint_engines(args.checkpoint_path, args.draft_checkpoint_path, options)
        text = Path(args.prompt_file).read_text(encoding="utf-8") if args.prompt_file else args.prompt
        prompt = engine.encode(text, chat=args.chat)
        what = f"{engine.checkpoint_dir}" + (f", draft {args.draft_checkpoint_path}" if draft else "")
    engine.check_fits(prompt, args.new_tokens)
    usual = usual_engine(engine, args) if args.batch_invariant else None
    setup = Setup(
        engine,
        prompt,
        args.new_tokens,
        args.repeats,
        args.ignore_eos,
        draft,
        args.prompt_lookup,
        args.agreements,
        usual,
    )
    started = time.strftime("%Y-%m-%d %H:%M")
    rows = run_rows(setup, args.k, write)
    write(
        f"\n{what}; {device_name(engine.device)}, torch {torch.__version__}, {dtype_name(engine.dtype)}, "
        f"compile {engine.compile}; {started}; greedy, prompt {len(prompt)} tokens, {args.new_tokens} new tokens, "
        f"median of {args.repeats} runs\n"
    )
    write(table(rows))
    if any(r.agreement is not None for r in rows):
        write("\n" + agreement_table(rows))
    if args.json is not None:
        write_text_atomic(Path(args.json), json.dumps([dataclasses.asdict(r) for r in rows], indent=2) + "\n")
    return rows


if __name__ == "__main__":  # python -m gpt_fast.bench.speculative: `gpt-fast bench speculative`
    from gpt_fast.cli.bench import run_alias

    run_alias("speculative")
