import math

import pytest
import torch

from gpt_fast.generation.sampling import (
    SamplingConfig,
    candidates,
    cumulative_sum,
    probabilities,
    row_noise,
    sample,
    sample_rows,
    sample_weights,
    seed_key,
    top_p_filter,
)


def test_temperature_zero_is_argmax():
    logits = torch.randn(3, 50)
    assert torch.equal(sample(logits, SamplingConfig(temperature=0)), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1e-30, 1e-12, 1e-6])
def test_temperatures_too_small_to_divide_by_are_greedy(temperature):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 1e9
    logits[:, 7] = 1e11  # one clear winner per row; divided by 1e-30 the logits would overflow to infinity
    for top_p in (1.0, 0.9):
        config = SamplingConfig(temperature=temperature, top_k=None, top_p=top_p)
        assert sample(logits, config).tolist() == [7, 7, 7]


def test_top_k_never_leaves_the_k_best():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    allowed = torch.topk(logits, 5).indices
    config = SamplingConfig(temperature=5.0, top_k=5)  # a high temperature flattens the distribution
    for _ in range(300):
        tokens = sample(logits, config)
        assert all(tokens[b].item() in allowed[b].tolist() for b in range(4))


def test_top_k_samples_every_candidate_eventually():
    torch.manual_seed(0)
    logits = torch.zeros(1, 10)
    seen = {sample(logits, SamplingConfig(temperature=1.0, top_k=3)).item() for _ in range(300)}
    assert len(seen) == 3


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(top_p_filter(probs.log(), 0.8))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8 exactly
    assert torch.isfinite(top_p_filter(probs.log(), 0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(top_p_filter(probs.log(), 0.4)).tolist() == [[True, False, False, False]]


def test_top_p_over_the_whole_vocabulary_maps_back_to_ids():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    scores, index = candidates(logits, SamplingConfig(temperature=1.0, top_k=None, top_p=0.8))
    assert index.tolist() == [[1, 3, 2, 0]]
    kept = index[torch.isfinite(scores)].tolist()
    probs = torch.softmax(logits, -1)[0]
    assert probs[1] < 0.8 <= probs[1] + probs[3]
    assert kept == [1, 3]
    torch.manual_seed(0)
    assert {sample(logits, SamplingConfig(temperature=1.0, top_k=None, top_p=0.8)).item() for _ in range(200)} == {1, 3}


def test_sampling_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    draws = torch.stack([sample(logits, SamplingConfig(temperature=1.0, top_k=None)) for _ in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=3).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)


@pytest.mark.parametrize("top_k, top_p", [(None, 1.0), (3, 1.0), (None, 0.75), (4, 0.8)])
def test_probabilities_are_what_sample_draws_from(top_k, top_p):
    logits = torch.log(torch.tensor([[0.05, 0.3, 0.1, 0.25, 0.2, 0.1]])).expand(20000, 6)
    config = SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p)
    probs = probabilities(logits, config)[0]
    kept = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    ranked = kept.argsort(descending=True, stable=True)[: top_k or 6]  # the top-k, then the top-p prefix of them
    mass = (kept[ranked] / kept[ranked].sum()).cumsum(0)
    ranked = ranked[: int((mass < top_p - 1e-6).sum()) + 1]
    expected = torch.zeros(6)
    expected[ranked] = kept[ranked] / kept[ranked].sum()
    torch.testing.assert_close(probs, expected)
    torch.manual_seed(0)
    freq = torch.bincount(sample(logits, config), minlength=6).float() / 20000
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_sample_weights_need_no_normalization():
    torch.manual_seed(0)
    weights = torch.tensor([[0.0, 3.0, 1.0, 0.0]]).expand(20000, 4)
    freq = torch.bincount(sample_weights(weights), minlength=4).float() / 20000
    torch.testing.assert_close(freq, torch.tensor([0.0, 0.75, 0.25, 0.0]), atol=0.015, rtol=0)


def test_same_seed_same_tokens():
    logits = torch.randn(2, 1000)
    config = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9)
    torch.manual_seed(123)
    first = [sample(logits, config) for _ in range(20)]
    torch.manual_seed(123)
    second = [sample(logits, config) for _ in range(20)]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_invalid_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


ROW_CONFIGS = [
    SamplingConfig(temperature=0),
    SamplingConfig(temperature=0.7, top_k=None),
    SamplingConfig(temperature=1.3, top_k=5),
    SamplingConfig(temperature=1.0, top_k=None, top_p=0.6),
    SamplingConfig(temperature=0.9, top_k=40, top_p=0.8),
]


def row_settings(configs, vocab):
    temperature = torch.tensor([c.temperature for c in configs])
    top_k = torch.tensor([vocab if c.top_k is None else c.top_k for c in configs])
    return temperature, top_k, torch.tensor([c.top_p for c in configs])


def reference_row(logits, config, noise):
    """One row sampled the single-stream way (:func:`candidates`' filtering), with the given Exp(1) draws [V]."""
    if config.greedy:
        return int(logits.argmax())
    scores, index = candidates(logits[None], config)
    ids = torch.arange(logits.shape[-1])[None] if index is None else index
    probs = torch.softmax(scores, dim=-1)
    return int(ids[0, torch.argmax(probs[0] / noise[ids[0]])])


def test_rows_sample_as_their_own_settings_say():
    """Each row filters and samples exactly as the single-stream sampler would with its settings and the same
    noise: greedy, temperature only, top-k, top-p, both."""
    vocab = 300
    logits = torch.randn(len(ROW_CONFIGS), vocab, generator=torch.Generator().manual_seed(0)) * 3
    keys = torch.tensor([seed_key(s) for s in range(len(ROW_CONFIGS))])
    for step in range(50):
        positions = torch.full((len(ROW_CONFIGS),), step)
        got = sample_rows(logits, *row_settings(ROW_CONFIGS, vocab), keys, positions)
        noise = row_noise(keys, positions, vocab)
        expected = [reference_row(logits[r], c, noise[r]) for r, c in enumerate(ROW_CONFIGS)]
        assert got.tolist() == expected


@pytest.mark.parametrize(
    "configs", [ROW_CONFIGS[:1] * 3, ROW_CONFIGS[:3], ROW_CONFIGS[2::-2]], ids=["all greedy", "no top-p", "top-k"]
)
def test_eager_cpu_rows_sample_as_the_fixed_shapes_do(configs):
    """Eager rows on the CPU take a shorter way (the argmax alone, or the top-k candidates alone) to the tokens the
    fixed shapes of a compiled step give, with the same noise."""
    vocab = 3000
    logits = torch.randn(len(configs), vocab, generator=torch.Generator().manual_seed(1)) * 3
    keys = torch.tensor([seed_key(s) for s in range(len(configs))])
    settings = row_settings(configs, vocab)
    for step in range(200):
        positions = torch.full((len(configs),), step)
        fixed = sample_rows(logits, *settings, keys, positions, fixed_shapes=True)
        assert torch.equal(sample_rows(logits, *settings, keys, positions), fixed)


def test_row_noise_depends_on_key_and_position_alone():
    keys = torch.tensor([seed_key(1), seed_key(2), seed_key(1)])
    positions = torch.tensor([5, 5, 5])
    noise = row_noise(keys, positions, 1000)
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    assert torch.equal(row_noise(keys[:1], positions[:1], 1000)[0], noise[0])  # whatever else is in the batch
    assert not torch.equal(row_noise(keys[:1], torch.tensor([6]), 1000)[0], noise[0])
    draws = row_noise(torch.tensor([seed_key(9)]), torch.tensor([0]), 200_000)[0]
    assert abs(draws.mean() - 1) < 0.01 and abs(draws.std() - 1) < 0.01  # Exp(1): mean and deviation 1


def test_a_row_never_samples_a_token_it_filtered_out():
    """Each token's noise is positive: at the positions where a token of the 49152 draws its smallest noise, a row
    whose only candidate is another token (top-k 1, or a constraint's mask) still samples that one. (A draw of 0
    made 0 / 0 of a filtered token, which argmax took.)"""
    vocab, key, positions = 49152, torch.tensor([seed_key(41)]), torch.arange(512)  # two such positions: 48, 274
    smallest = [row_noise(key.expand(128), chunk, vocab).min(dim=-1) for chunk in positions.split(128)]  # [128] each
    least, tokens = torch.cat([s.values for s in smallest]), torch.cat([s.indices for s in smallest])  # [512]
    assert (least > 0).all()
    logits = torch.zeros(1, vocab)
    for position in least.topk(8, largest=False).indices.tolist():
        only = (tokens[position].item() + 1) % vocab
        filtered = torch.full((1, vocab), float("-inf")).index_fill_(1, torch.tensor([only]), 0.0)
        ones = torch.ones(1)
        for scores, top_k in ((logits.index_fill(1, torch.tensor([only]), 1.0), 1), (filtered, vocab)):
            got = sample_rows(scores, ones, torch.tensor([top_k]), ones, key, torch.tensor([position]))
            assert got.item() == only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_row_noise_is_the_same_on_the_gpu():
    """The hash is exact integer arithmetic on every device: a seeded request samples alike on the CPU and a GPU."""
    keys = torch.tensor([seed_key(0), seed_key(7), seed_key(2**70)])
    positions = torch.tensor([0, 513, 2**20])
    on_cpu = row_noise(keys, positions, 32000)
    on_gpu = row_noise(keys.cuda(), positions.cuda(), 32000).cpu()
    torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-6, atol=0)  # the integers alike; the log within a rounding


def test_rows_follow_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))[None].expand(4000, 3)
    ones = torch.ones(4000)
    keys = torch.tensor([seed_key(i) for i in range(4000)])
    draws = sample_rows(logits, ones, torch.full((4000,), 3), ones, keys, torch.zeros(4000, dtype=torch.long))
    freq = torch.bincount(draws, minlength=3).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)


def test_seed_keys_are_32_bit_and_take_any_integer():
    keys = {seed_key(s) for s in (0, 1, -1, 2**64, -(2**100), 12345678901234567890)}
    assert len(keys) == 6 and all(0 <= k < 2**32 for k in keys)


@pytest.mark.parametrize("shape", [(1, 5), (8, 32000), (3, 256), (2, 4, 257)])
def test_cumulative_sum_is_torchs_cumsum(shape):
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(cumulative_sum(x), torch.cumsum(x, dim=-1))
