"""The batched step's logit adjustments (generation/slots.py) against their definitions: OpenAI's formula for the
presence and frequency penalties, and transformers' own processors for the repetition penalty and min-p."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from gpt_fast.generation.options import LogitAdjustments, SamplingConfig
from gpt_fast.generation.slots import (
    MIN_PREFILL_LENGTH,
    PREFILL_ROWS,
    PREFILL_TOKENS,
    RowPrefill,
    RowPrefills,
    SlotState,
    adjusted_logits,
    decode_slots,
    min_p_filter,
    move_rows,
    prefill_shape,
    prefill_shapes,
    sample_into,
)
from gpt_fast.model.config import ModelConfig
from gpt_fast.model.transformer import Transformer

VOCAB = 50


def state_with(*adjusts: LogitAdjustments, prompts=None, temperature: float = 1.0) -> SlotState:
    state = SlotState(len(adjusts), VOCAB, "cpu")
    for slot, adjust in enumerate(adjusts):
        prompt = torch.tensor(prompts[slot] if prompts else [0])
        state.configure(slot, SamplingConfig(temperature=temperature, top_k=None), slot, adjust, prompt)
    return state


def test_presence_and_frequency_penalties_follow_openais_formula():
    adjust = LogitAdjustments(presence_penalty=0.7, frequency_penalty=0.3, logit_bias=((4, 5.0), (9, -2.5)))
    state = state_with(adjust, LogitAdjustments(), prompts=[[1], [1]])
    counts = torch.zeros(2, VOCAB, dtype=torch.int32)
    counts[:, 3], counts[:, 7] = 2, 1
    state.counts.copy_(counts)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    got = adjusted_logits(state, slice(0, 2), logits)
    bias = torch.zeros(VOCAB)
    bias[4], bias[9] = 5.0, -2.5
    # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, after the logit bias
    expected = logits[0] + bias - counts[0] * 0.3 - (counts[0] > 0).float() * 0.7
    torch.testing.assert_close(got[0], expected)
    torch.testing.assert_close(got[1], logits[1])  # the other slot's request changes nothing


def test_the_repetition_penalty_is_transformers_over_the_prompt_and_the_answer():
    prompt, answer = [2, 5, 5, 11], [7, 2]
    state = state_with(LogitAdjustments(repetition_penalty=1.3), prompts=[prompt])
    for token in answer:
        state.counts[0, token] += 1
        state.seen[0, token] = True
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    reference = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + answer]), logits.clone())
    torch.testing.assert_close(adjusted_logits(state, slice(0, 1), logits), reference)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_min_p_keeps_the_tokens_transformers_keeps(temperature):
    state = state_with(LogitAdjustments(min_p=0.1), temperature=temperature)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    reference = MinPLogitsWarper(0.1)(torch.zeros(1, 1, dtype=torch.long), logits / temperature)
    got = min_p_filter(state, slice(0, 1), logits)
    assert torch.equal(torch.isinf(got), torch.isinf(reference))


def test_sampling_counts_the_answers_tokens():
    state = state_with(LogitAdjustments(frequency_penalty=2.0), temperature=0.0)
    logits = torch.zeros(1, VOCAB)
    logits[0, 6], logits[0, 8] = 3.0, 2.5
    picks = []
    for position in range(3):
        sample_into(state, slice(0, 1), logits, torch.tensor([position]))
        picks.append(int(state.tokens[0]))
    assert picks == [6, 8, 6]  # 6 taken once scores 1.0 < 2.5; 8 taken once scores 0.5 < 1.0
    assert state.counts[0, 6] == 2 and state.counts[0, 8] == 1 and int(state.counts[0].sum()) == 3


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_eager_steps_skip_what_no_row_asks_for_and_sample_the_same(temperature):
    """An eager CPU step whose rows have no adjustments and report no log-probabilities skips both, and samples the
    tokens of the full path (forced here by marking the rows adjusted, with adjustments that change nothing); a
    row that reports them gets the full path's log-probabilities."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    positions = torch.tensor([5, 9, 2])
    runs = {}
    for name, adjusted, scored in [("full", True, True), ("skipped", False, False), ("scored", False, True)]:
        state = SlotState(3, VOCAB, "cpu")
        for slot in range(3):
            sampling = SamplingConfig(temperature=temperature, top_k=None)
            state.configure(slot, sampling, slot, LogitAdjustments(), torch.tensor([0]), scored=scored and slot == 1)
        assert not state.adjusted.any()
        state.adjusted.fill_(adjusted)
        sample_into(state, slice(0, 3), logits, positions)
        runs[name] = state
    assert torch.equal(runs["skipped"].tokens, runs["full"].tokens)
    assert torch.equal(runs["scored"].tokens, runs["full"].tokens)
    assert not runs["skipped"].logprobs.any()  # never written
    torch.testing.assert_close(runs["scored"].logprobs, runs["full"].logprobs)
    assert torch.equal(runs["scored"].top_ids, runs["full"].top_ids)


def test_adjustments_refuse_values_out_of_range():
    for bad in ({"presence_penalty": 3}, {"repetition_penalty": 0}, {"min_p": 1.5}, {"logit_bias": ((-1, 1.0),)},
                {"logit_bias": ((1, 200.0),)}, {"frequency_penalty": float("nan")}):  # fmt: skip
        with pytest.raises(ValueError, match="must be|at most"):
            LogitAdjustments(**bad)


def test_prefill_shapes_are_powers_of_two_within_one_prefills_budget():
    assert prefill_shape(1, 1) == (1, MIN_PREFILL_LENGTH)
    assert prefill_shape(3, 33) == (4, 64)
    assert prefill_shape(PREFILL_ROWS + 1, 1) is None
    assert prefill_shape(PREFILL_ROWS, PREFILL_TOKENS // PREFILL_ROWS + 1) is None
    shapes = prefill_shapes(384)
    assert (PREFILL_ROWS, 256) in shapes and (1, 256) in shapes and (1, 512) not in shapes
    assert all(rows * length <= PREFILL_TOKENS and length <= 384 for rows, length in shapes)


@torch.no_grad()
def test_prompts_prefilled_together_continue_as_their_full_forward():
    """Three prompts into a paged cache in one padded prefill, two of them after blocks computed already (a prefix
    cache hit): each slot's first token, its log-probability and the next decode step's logits are those of the
    model's full forward over the whole sequence (a static cache of its own)."""
    torch.manual_seed(0)
    config = ModelConfig(
        block_size=64, vocab_size=VOCAB, n_layer=2, n_head=4, n_local_heads=2, dim=32, intermediate_size=48,
        head_dim=8, rope_base=10000.0, norm_eps=1e-5,
    )  # fmt: skip
    model = Transformer(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.eval()
    slots, block = 4, 4
    model.setup_caches(slots + PREFILL_ROWS, 48, blocks=40, block_size=block)
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (13, 9, 6)]
    done = [8, 0, 4]  # positions already in each prompt's blocks
    table = model.block_table.blocks
    for row, first in enumerate((1, 13, 25)):
        table[slots + row, :12] = torch.arange(first, first + 12)
        table[(2, 0, 3)[row], :12] = torch.arange(first, first + 12)
    for row in (0, 2):  # the positions computed before: a prefill of the prompt's start in the slot's own row
        slot = (2, 0, 3)[row]
        model(prompts[row][None, : done[row]], torch.arange(done[row]), first_row=slot)
    state = SlotState(slots + PREFILL_ROWS, VOCAB, "cpu")
    for row, prompt in enumerate(prompts):
        state.configure(slots + row, SamplingConfig(temperature=0), 0, LogitAdjustments(), prompt)
    RowPrefills(model, state, slots, graphs=False)(
        [RowPrefill(p[start:].tolist(), start) for p, start in zip(prompts, done, strict=True)]
    )
    move_rows(state, slots, torch.tensor([2, 0, 3]))
    firsts, logprobs = state.tokens[[2, 0, 3]].tolist(), state.logprobs[[2, 0, 3], 0].tolist()
    decode_slots(model, state, slots)
    reference = Transformer(config)
    reference.load_state_dict(model.state_dict())
    reference.setup_caches(1, 48)
    for row, slot in enumerate((2, 0, 3)):
        first = reference(prompts[row][None], torch.arange(len(prompts[row])), from_start=True)[0, -1]
        token = int(first.argmax())
        assert firsts[row] == token
        assert logprobs[row] == pytest.approx(float(first.log_softmax(-1)[token]), abs=1e-5)
        sequence = torch.cat((prompts[row], torch.tensor([token])))
        following = reference(sequence[None], torch.arange(len(sequence)), from_start=True)[0, -1]
        assert int(state.tokens[slot]) == int(following.argmax())
        assert int(state.input_pos[slot]) == len(sequence)
