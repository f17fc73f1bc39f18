"""Speculative decoding: greedy output identical to plain decoding with every drafter, compile mode and batch size;
sampled output distributed as the target's (a probability-integral-transform test against the target's own
conditionals, computed by full forwards and filtered by a reference implementation of top-k / top-p); the options
and the draft checkpoint's checks."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpt_fast.cli.main import flag_of
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.decode import generate, make_steps
from gpt_fast.generation.drafters import DraftModel, PromptLookup, Replay
from gpt_fast.generation.loop import drain
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.generation.speculative import (
    SpeculativeOptions,
    accept_sampled,
    make_speculative_steps,
    speculative_cache_length,
    speculative_stream,
)
from gpt_fast.model.config import ModelConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import Transformer
from gpt_fast.util.options import OptionError
from tests.tiny import one_torch_thread

GREEDY = SamplingConfig(temperature=0)
PROMPTS = Path(__file__).resolve().parent.parent / "prompts"
PROMPT = [5, 17, 42, 8, 99, 3, 17, 42, 8, 7, 5, 17]
CONFIG = replace(get_shape("tiny"), block_size=1024, vocab_size=128)


def random_model(seed: int, std: float = 0.5, config: ModelConfig = CONFIG, like: Transformer | None = None):
    """A model with well-separated logits (no argmax near-ties); with ``like``, that model's weights plus noise of
    ``std`` (a draft that agrees with it often, not always)."""
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, std)
            if like is not None:
                p.add_(like.get_parameter(name))
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def target():
    return random_model(0)


@pytest.fixture(scope="module")
def drafts(target):
    """name -> a drafter factory (k): prompt lookup, an unrelated draft, a close draft, the target itself."""
    unrelated, close = random_model(1), random_model(2, std=0.15, like=target)
    return {
        "lookup": lambda k: PromptLookup(3, k),
        "unrelated draft": lambda k: DraftModel(unrelated, k),
        "close draft": lambda k: DraftModel(close, k),
        "target as draft": lambda k: DraftModel(target, k),
    }


def speculate(model, drafter, prompt=PROMPT, n=40, sampling=GREEDY, mode="none", **kwargs):
    stream = speculative_stream(
        model,
        drafter,
        prompt,
        max_new_tokens=n,
        sampling=sampling,
        steps=make_steps(mode),
        spec_steps=make_speculative_steps(mode),
        emit=False,
        **kwargs,
    )
    return drain(stream, None)


def plain(model, prompt=PROMPT, n=40, sampling=GREEDY, **kwargs):
    return generate(model, prompt, max_new_tokens=n, sampling=sampling, steps=make_steps("none"), **kwargs)


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("name", ["lookup", "unrelated draft", "close draft", "target as draft"])
def test_greedy_speculation_is_plain_decoding(target, drafts, name, k, batch_size):
    expected = plain(target, batch_size=batch_size).tokens
    result = speculate(target, drafts[name](k), batch_size=batch_size)
    assert result.tokens == expected
    stats = result.speculative
    assert stats.k == k and stats.rounds >= 1 and 0 <= stats.accepted <= stats.rounds * k
    if name == "target as draft":
        assert stats.acceptance_rate == 1.0 and stats.tokens_per_step == k + 1


def test_replay_of_the_greedy_continuation_is_always_accepted(target):
    expected = plain(target, n=60).tokens[0]
    result = speculate(target, Replay(PROMPT + expected, k=4), n=50)
    assert result.tokens == [expected[:50]]
    assert result.speculative.acceptance_rate == 1.0


def test_replay_agreement_sets_the_acceptance(target):
    expected = plain(target, n=300).tokens[0]
    torch.manual_seed(0)
    result = speculate(target, Replay(PROMPT + expected, k=1, agreement=0.5), n=200)
    assert result.tokens == [expected[:200]]
    assert 0.4 < result.speculative.acceptance_rate < 0.6


def test_the_prompt_lookup_round_trip_on_repetitive_text(target):
    prompt = [7, 8, 9, 10, 11] * 6
    result = speculate(target, PromptLookup(2, 4), prompt=prompt, n=30)
    assert result.tokens == plain(target, prompt=prompt, n=30).tokens
    assert result.speculative.rounds < 30  # some proposals were kept


@pytest.mark.parametrize("n", [1, 2, 3])
def test_the_shortest_requests(target, drafts, n):
    for name in ("lookup", "target as draft"):
        assert speculate(target, drafts[name](4), n=n).tokens == plain(target, n=n).tokens


def test_stops_at_a_stop_token_and_keeps_it(target, drafts):
    full = plain(target).tokens[0]
    stop = full[10]
    expected = plain(target, stop_ids=[stop]).tokens
    assert expected[0][-1] == stop and len(expected[0]) <= 11
    for name in ("lookup", "target as draft"):
        assert speculate(target, drafts[name](4), stop_ids=[stop]).tokens == expected


def test_tokens_are_emitted_in_order(target, drafts):
    seen = []
    stream = speculative_stream(
        target,
        drafts["target as draft"](3),
        PROMPT,
        max_new_tokens=17,
        sampling=GREEDY,
        steps=make_steps("none"),
        spec_steps=make_speculative_steps("none"),
        batch_size=2,
    )
    result = drain(stream, seen.append)
    assert [list(row) for row in zip(*seen, strict=True)] == result.tokens and len(seen) == 17


@pytest.mark.slow
def test_compiled_speculation_is_plain_decoding(target, drafts):
    """``default`` mode, the compile mode besides ``none`` that runs on a CPU."""
    torch._dynamo.reset()
    for batch_size in (1, 2):
        expected = plain(target, batch_size=batch_size).tokens
        for name in ("lookup", "close draft"):
            assert speculate(target, drafts[name](3), mode="default", batch_size=batch_size).tokens == expected
        replay = Replay(PROMPT + expected[0] + [0] * 8, k=3)
        assert speculate(target, replay, mode="default", batch_size=batch_size).tokens == expected


@torch.no_grad()
def test_a_forward_over_several_positions_is_that_many_single_steps(target):
    """What the verify step relies on: the causal mask and rotary embedding of a forward over T positions starting
    anywhere in the cache, with stale entries beyond, give the logits of T one-position forwards."""
    ids = torch.tensor([PROMPT + [9, 8, 7, 6, 5]])  # [1, 17]
    target.setup_caches(1, 64)

    def stale_from(position: int) -> None:
        for layer in target.layers:
            layer.attention.kv_cache.kv[..., position:, :].normal_()

    stale_from(0)
    target(ids[:, :12], torch.arange(12))
    one_by_one = torch.cat([target(ids[:, p : p + 1], torch.tensor([p])) for p in range(12, 17)], dim=1)
    stale_from(12)
    together = target(ids[:, 12:], torch.arange(12, 17))  # [1, 5, V]
    torch.testing.assert_close(together, one_by_one, rtol=1e-4, atol=1e-4)


def test_the_cache_holds_the_rounds_the_host_may_run_ahead():
    assert speculative_cache_length(100, 50, 4, 1024) == 192  # 100 + 50 + 3 * 5 = 165, rounded up
    assert speculative_cache_length(1000, 24, 4, 1024) == 1088  # beyond the context: only dropped tokens go there
    with pytest.raises(ValueError, match="exceeds the model's context"):
        speculative_cache_length(1000, 25, 4, 1024)


# --- sampling: the target's distribution, exactly ------------------------------------------------------------------

SMALL = replace(CONFIG, vocab_size=24, n_head=2, dim=16, intermediate_size=32, n_local_heads=1, head_dim=8)
RANKS = 5  # bins: the target's most likely token, second, third, fourth, any other


def reference_probabilities(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p, written out plainly one distribution [V] at a time (float64)."""
    out = []
    for row in logits.reshape(-1, logits.shape[-1]).double() / config.temperature:
        order = torch.argsort(row, descending=True, stable=True)[: config.top_k or len(row)].tolist()
        mass = torch.softmax(row[order], -1).tolist()
        kept, total = [], 0.0
        for token, p in zip(order, mass, strict=True):
            if total >= config.top_p:
                break
            kept.append(token)
            total += p
        filtered = torch.zeros_like(row)
        filtered[kept] = torch.softmax(row[kept], -1)
        out.append(filtered)
    return torch.stack(out).reshape(logits.shape)


def rank_p_value(model: Transformer, prompt: list[int], rows: list[list[int]], config: SamplingConfig) -> float:
    """Chi-square p-value that the generated ``rows`` are ``model``'s samples, from the rank of each token in the
    model's filtered distribution given what precedes it (computed by one full forward per row): observed counts
    of ranks 0, 1, 2, 3, 4+ against their expected counts, the sums of those distributions' sorted masses."""
    observed = torch.zeros(RANKS, dtype=torch.float64)
    expected = torch.zeros(RANKS, dtype=torch.float64)
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([prompt + row])
            model.setup_caches(1, 1024)
            probs = reference_probabilities(model(ids, torch.arange(ids.shape[1]))[0, len(prompt) - 1 : -1], config)
            order = torch.argsort(probs, dim=-1, descending=True, stable=True)  # [N, V]
            rank = torch.argsort(order, dim=-1, stable=True)[torch.arange(len(row)), torch.tensor(row)]  # [N]
            observed += torch.bincount(rank.clamp_max(RANKS - 1), minlength=RANKS)
            sorted_probs = probs.gather(-1, order)
            expected += torch.cat([sorted_probs[:, : RANKS - 1], sorted_probs[:, RANKS - 1 :].sum(-1, True)], -1).sum(0)
    chi2 = ((observed - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((RANKS - 1) / 2, dtype=torch.float64), chi2 / 2).item()


SAMPLINGS = [SamplingConfig(temperature=1.0, top_k=None), SamplingConfig(temperature=0.9, top_k=12, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["temperature", "top-k-top-p"])
def test_sampled_speculation_keeps_the_target_distribution(sampling):
    target = random_model(10, std=0.6, config=SMALL)
    draft = random_model(11, std=0.2, config=SMALL, like=target)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    torch.manual_seed(0)
    with_draft = speculate(target, DraftModel(draft, 4), prompt, n=300, sampling=sampling)
    rows_apart = speculate(target, DraftModel(draft, 4), prompt, n=200, sampling=sampling, batch_size=2)
    with_lookup = speculate(target, PromptLookup(2, 3), prompt, n=200, sampling=sampling)
    without = plain(target, prompt, n=200, sampling=sampling, batch_size=2)
    assert with_draft.speculative.tokens_per_step > 1.3  # proposals beyond the first of a round were kept too
    for result in (with_draft, rows_apart, with_lookup, without):
        assert rank_p_value(target, prompt, result.tokens, sampling) > 1e-3
    # The test can fail: the draft's own samples are told apart from the target's.
    drafted = plain(draft, prompt, n=300, sampling=sampling)
    assert rank_p_value(target, prompt, drafted.tokens, sampling) < 1e-6


def test_accept_rule_draws_each_position_from_the_target():
    """Rows are independent here (no shared position): at every position, over the rows that reach it, the token
    follows the target's distribution p even though the proposals follow a very different q."""
    rows, k, vocab = 20000, 3, 5
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(k + 1, vocab, generator=generator).expand(rows, k + 1, vocab)
    q = torch.softmax(torch.randn(k, vocab, generator=generator) * 2, -1).expand(rows, k, vocab)
    torch.manual_seed(0)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1).reshape(rows, k)
    sampling = SamplingConfig(temperature=1.0, top_k=None)
    out, accepted = accept_sampled(logits, drafts, q.contiguous(), sampling)
    p = torch.softmax(logits[0], -1)
    for position in range(k + 1):
        reached = out[accepted >= position, position]
        assert len(reached) > 1000
        observed = torch.bincount(reached, minlength=vocab).double()
        expected = p[position].double() * len(reached)
        chi2 = ((observed - expected) ** 2 / expected).sum()
        assert torch.special.gammaincc(torch.tensor((vocab - 1) / 2.0), chi2 / 2) > 1e-3
    assert (accepted == k).any() and (accepted == 0).any()


# --- options and checks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "takes one drafter"),
        ({"draft_checkpoint": "x", "prompt_lookup": 2}, "takes one drafter"),
        ({"prompt_lookup": 0}, r"--prompt_lookup must be an integer in 1\.\.16, got 0"),
        ({"prompt_lookup": 2, "k": 0}, r"--speculate_k must be an integer in 1\.\.16, got 0"),
        ({"prompt_lookup": 2, "k": 17}, "--speculate_k must be"),
        ({"draft_checkpoint": ""}, "--draft_checkpoint_path is empty"),
    ],
)
def test_options_check_themselves(kwargs, message):
    """The library names its options; the command line's flags are the same names."""
    with pytest.raises(OptionError) as error:
        SpeculativeOptions(**kwargs)
    assert re.search(message, error.value.naming(flag_of))


def test_options_from_flags():
    assert SpeculativeOptions.from_flags(None, None, None) is None
    assert SpeculativeOptions.from_flags(None, 3, None) == SpeculativeOptions(prompt_lookup=3, k=4)
    assert SpeculativeOptions.from_flags("d", None, 6) == SpeculativeOptions(draft_checkpoint="d", k=6)
    with pytest.raises(ValueError, match="--speculate_k goes with --draft_checkpoint_path or --prompt_lookup"):
        SpeculativeOptions.from_flags(None, None, 4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    tiny = get_shape("tiny")
    make = make_random_checkpoint
    return {
        "target": make(tiny, folder / "target", dtype=torch.float32, seed=3).parent,
        "draft": make(tiny, folder / "draft", dtype=torch.float32, seed=4).parent,
        "other vocab": make(replace(tiny, vocab_size=384), folder / "v", dtype=torch.float32).parent,
    }


def test_a_draft_checkpoint_drafts_for_the_engine(checkpoints):
    options = EngineOptions(device="cpu", speculative=SpeculativeOptions(draft_checkpoint=str(checkpoints["draft"])))
    engine = Engine.open(checkpoints["target"], options)
    engine.load_weights()
    plain_engine = Engine.load(checkpoints["target"], device="cpu")
    prompt = engine.encode("hello hello hello")
    result = engine.generate_ids(prompt, 20, GREEDY, ignore_eos=True)
    assert result.tokens == plain_engine.generate_ids(prompt, 20, GREEDY, ignore_eos=True).tokens
    assert result.speculative.drafter == "draft model" and result.speculative.draft_seconds > 0
    assert list(engine.stream_ids(prompt, 20, GREEDY)) == list(plain_engine.stream_ids(prompt, 20, GREEDY))


def test_a_draft_must_share_the_vocabulary(checkpoints):
    options = EngineOptions(speculative=SpeculativeOptions(draft_checkpoint=str(checkpoints["other vocab"])))
    with pytest.raises(ValueError, match=r"config\.json: model\.vocab_size 384 differs from the target's 512"):
        Engine.open(checkpoints["target"], options)


def test_a_draft_must_share_the_tokenizer(checkpoints, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(checkpoints["draft"], draft)
    config = json.loads((draft / "config.json").read_text())
    config["tokenizer"]["special_tokens"] = {"<s>": 257, "</s>": 256}
    (draft / "config.json").write_text(json.dumps(config))
    options = EngineOptions(speculative=SpeculativeOptions(draft_checkpoint=str(draft)))
    with pytest.raises(ValueError, match=r"draft/config\.json: tokenizer\.special_tokens differs from the target's"):
        Engine.open(checkpoints["target"], options)


@pytest.mark.slow
def test_the_default_model_copies_with_prompt_lookup_and_keeps_its_text(smollm2_checkpoint):
    """Real weights: a copy-heavy prompt, greedy, the same text with and without prompt lookup, most proposals kept."""
    engine = Engine.load(smollm2_checkpoint, device="cpu", dtype="float32")
    prompt = engine.encode((PROMPTS / "rewrite_with_type_hints.txt").read_text(), chat=True)
    expected = engine.generate_ids(prompt, 40, GREEDY).tokens
    result = engine.generate_ids(prompt, 40, GREEDY, drafter=PromptLookup(3, 4))
    assert result.tokens == expected and result.speculative.acceptance_rate > 0.5, engine.decode(expected[0])
