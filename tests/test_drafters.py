"""The drafters: prompt lookup against a plain-Python reference, replay, and the buffers a round passes along."""

import random

import pytest
import torch

from gpt_fast.generation.drafters import PromptLookup, Replay, lookup_drafts
from gpt_fast.generation.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0)


def reference_lookup(tokens: list[int], pos: int, ngram: int, k: int) -> list[int]:
    """The longest earlier match of the last 1..ngram tokens (ending before ``pos``), the latest of equally long
    ones; then the k tokens after it, starting over at the match's end where they would reach past ``pos``."""
    for length in range(min(ngram, pos + 1), 0, -1):
        pattern = tokens[pos - length + 1 : pos + 1]
        ends = [e for e in range(length - 1, pos) if tokens[e - length + 1 : e + 1] == pattern]
        if ends:
            best = ends[-1]
            break
    else:
        best = pos - 1
    period = pos - best
    return [tokens[best + 1 + i % period] for i in range(k)]


@pytest.mark.parametrize("seed", range(8))
def test_lookup_matches_the_reference(seed):
    rng = random.Random(seed)
    vocab, length, ngram, k = rng.choice([3, 5, 50]), 40, rng.randint(1, 5), rng.randint(1, 6)
    rows = [[rng.randrange(vocab) for _ in range(length)] for _ in range(3)]
    for pos in range(1, length):
        got = lookup_drafts(torch.tensor(rows), torch.tensor([pos]), ngram, k).tolist()
        assert got == [reference_lookup(row, pos, ngram, k) for row in rows], (pos, ngram, k)


def test_lookup_proposes_what_followed_and_continues_repetitions():
    tokens = torch.tensor([[9, 1, 2, 3, 4, 5, 7, 7, 1, 2, 3, 0, 0]])  # the buffer beyond position 10 is stale
    assert lookup_drafts(tokens, torch.tensor([10]), 3, 4).tolist() == [[4, 5, 7, 7]]
    repeating = torch.tensor([[5, 6, 5, 6, 5, 6, 0, 0]])
    assert lookup_drafts(repeating, torch.tensor([5]), 2, 5).tolist() == [[5, 6, 5, 6, 5]]
    nothing = torch.tensor([[1, 2, 3, 4, 0]])
    assert lookup_drafts(nothing, torch.tensor([3]), 2, 3).tolist() == [[4, 4, 4]]


def test_round_buffers_are_kept_while_their_shape_stays():
    lookup = PromptLookup(2, 4)
    first = lookup.setup(2, 128, 50, GREEDY, torch.device("cpu"))
    assert lookup.setup(2, 256, 50, GREEDY, torch.device("cpu")) is first  # a CUDA graph holds their addresses
    assert first.drafts.shape == (2, 4) and first.out.shape == (2, 6) and first.probs.numel() == 0
    assert lookup.setup(3, 128, 50, GREEDY, torch.device("cpu")) is not first


def test_replay_proposes_the_recording_and_spoils_at_the_asked_rate():
    sequence = list(range(100, 140))
    replay = Replay(sequence, k=3)
    replay.setup(1, 64, 1000, GREEDY, torch.device("cpu"))
    state = torch.nn.Module()
    state.input_pos = torch.tensor([5])
    replay.propose(state)
    assert replay.spec.drafts.tolist() == [[106, 107, 108]]
    state.input_pos = torch.tensor([38])
    replay.propose(state)
    assert replay.spec.drafts.tolist() == [[139, 0, 0]]  # past the recording: whatever (it is never accepted)
    torch.manual_seed(0)
    half = Replay(sequence, k=8, agreement=0.5)
    half.setup(2000, 64, 1000, GREEDY, torch.device("cpu"))
    state.input_pos = torch.tensor([5])
    half.propose(state)
    kept = (half.spec.drafts == torch.tensor(sequence[6:14])).float().mean().item()
    assert 0.45 < kept < 0.55 and (half.spec.drafts != torch.tensor(sequence[6:14])).any()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: PromptLookup(0, 4), r"prompt_lookup must be an integer in 1\.\.16, got 0"),
        (lambda: PromptLookup(2, 0), r"^k must be an integer in 1\.\.16, got 0"),
        (lambda: PromptLookup(2, True), "^k must be an integer"),
        (lambda: Replay([1], 4, agreement=1.5), r"agreement must be in \[0, 1\]"),
    ],
)
def test_bad_settings(make, message):
    with pytest.raises(ValueError, match=message):
        make()
