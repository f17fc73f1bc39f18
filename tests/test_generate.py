import dataclasses

import pytest
import torch

from gpt_fast.generation.decode import (
    CompileCacheUse,
    GraphedPrefill,
    Steps,
    cache_length,
    compile_options,
    compiled_prefill,
    decode_one_token,
    generate,
    make_steps,
    prefill,
    prefill_padded,
)
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.model.config import ModelConfig
from gpt_fast.model.transformer import Transformer
from gpt_fast.util.choices import HEURISTIC

GREEDY = SamplingConfig(temperature=0)
PROMPT = [5, 17, 42, 8, 99, 3]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(
        block_size=256,
        vocab_size=128,
        n_layer=2,
        n_head=4,
        dim=32,
        intermediate_size=64,
        n_local_heads=2,
        head_dim=8,
        rope_base=10000.0,
        norm_eps=1e-5,
    )
    model = Transformer(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return model.eval()


def greedy(model, **kwargs):
    return generate(
        model,
        PROMPT,
        max_new_tokens=kwargs.pop("max_new_tokens", 30),
        sampling=GREEDY,
        steps=make_steps("none"),
        **kwargs,
    )


def reference_greedy(model, n):
    """Greedy decoding by full forwards over the growing sequence (no incremental cache use)."""
    ids = list(PROMPT)
    for _ in range(n):
        model.setup_caches(1, 256)
        logits = model(torch.tensor([ids]), torch.arange(len(ids)))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


@torch.no_grad()
def test_greedy_matches_full_forward_decoding(model):
    assert greedy(model).tokens == [reference_greedy(model, 30)]


@torch.no_grad()
def test_the_decode_step_reads_no_default_of_the_models_forward(model, monkeypatch):
    """The step that ``--aot_precompile`` packages passes every keyword of ``Transformer.forward``: torch 2.11 saves
    a package guarding a default argument but cannot load it again (the GPU image's torch; the CI's 2.13 loads it,
    so tests/test_precompile.py alone would not see it). Without the defaults an omitted keyword raises."""
    model.setup_caches(1, 64)
    prefill(model, torch.tensor([PROMPT]), GREEDY)
    monkeypatch.setattr(Transformer.forward, "__kwdefaults__", None)
    decode_one_token(model, GREEDY)
    assert int(model.decode_state.input_pos) == len(PROMPT) + 1


def test_compiled_greedy_equals_eager(model):
    torch._dynamo.reset()
    compiled = generate(
        model, PROMPT, max_new_tokens=30, sampling=GREEDY, steps=make_steps("default", compile_prefill=True)
    )
    assert compiled.tokens == greedy(model).tokens
    longer_prompt = generate(
        model, PROMPT * 2, max_new_tokens=5, sampling=GREEDY, steps=make_steps("default", compile_prefill=True)
    )
    assert (
        longer_prompt.tokens
        == generate(model, PROMPT * 2, max_new_tokens=5, sampling=GREEDY, steps=make_steps("none")).tokens
    )


@torch.no_grad()
def test_generations_of_two_models_take_turns_on_one_compiled_step(model):
    """Two models of different shapes, whose decode steps are two compiled versions of one function, decoding in
    turns: each gives its eager tokens, with Dynamo checking a module's guards only where its ``__dict__`` changed
    (:func:`gpt_fast.util.settings.apply_step_settings`, on for the test run)."""
    torch.manual_seed(1)
    other = Transformer(dataclasses.replace(model.config, n_layer=3))
    for p in other.parameters():
        torch.nn.init.normal_(p, std=0.5)
    other.eval()
    steps = make_steps("default")
    expected = {m: greedy(m, max_new_tokens=12).tokens for m in (model, other)}
    for m in (model, other, model, other):
        assert generate(m, PROMPT, max_new_tokens=12, sampling=GREEDY, steps=steps).tokens == expected[m]


def test_compiled_prefill_samples_with_top_k_and_top_p(model):
    torch._dynamo.reset()
    steps = make_steps("default", compile_prefill=True)
    for prompt, sampling in (
        (PROMPT, SamplingConfig(temperature=0.8, top_k=50)),
        (PROMPT[:3], SamplingConfig(temperature=1.0, top_k=20, top_p=0.9)),
    ):
        result = generate(model, prompt, max_new_tokens=4, sampling=sampling, steps=steps)
        assert len(result.tokens[0]) == 4 and all(0 <= t < 128 for t in result.tokens[0])


@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 2])
def test_padded_prefill_equals_the_prefill_on_the_prompt(model, rows):
    """What a padded prefill leaves for the decode steps: the prompt's keys and values, its first token, the
    position; the padding's entries lie beyond it, where decode steps write before they read."""
    prompt = torch.tensor([PROMPT] * rows)
    model.setup_caches(rows, 128)
    prefill(model, prompt, GREEDY)
    expected = [layer.attention.kv_cache.kv.clone() for layer in model.layers]
    tokens, position = model.decode_state.tokens.clone(), model.decode_state.input_pos.clone()
    padded = torch.cat((prompt, torch.randint(0, 128, (rows, 64 - len(PROMPT)))), dim=1)
    prefill_padded(model, padded, torch.tensor([len(PROMPT)]), GREEDY)
    length = len(PROMPT)
    for layer, before in zip(model.layers, expected, strict=True):
        torch.testing.assert_close(layer.attention.kv_cache.kv[:, :, :, :length], before[:, :, :, :length])
    assert torch.equal(model.decode_state.tokens[:, : length + 1], tokens[:, : length + 1])
    assert torch.equal(model.decode_state.input_pos, position)


@torch.no_grad()
def test_compiled_padded_prefill_equals_the_eager_one(model):
    """The padded prefill that GraphedPrefill captures with --compile_prefill, compiled once for every padded length
    (64 and 128 here), leaves the caches, tokens and position the eager one does."""
    torch._dynamo.reset()
    compiled = compiled_prefill(HEURISTIC, prefill_padded)
    for padded_length in (64, 128):
        padded = torch.randint(0, 128, (1, padded_length), generator=torch.Generator().manual_seed(padded_length))
        length = torch.tensor([len(PROMPT) + padded_length // 2])
        model.setup_caches(1, 192)
        state, results = model.decode_state, []
        for step in (prefill_padded, compiled):
            for buffer in [layer.attention.kv_cache.kv for layer in model.layers] + [state.tokens, state.input_pos]:
                buffer.zero_()  # nothing left over from the other step
            step(model, padded, length, GREEDY)
            kv = [layer.attention.kv_cache.kv.clone() for layer in model.layers]
            results.append((kv, state.tokens.clone(), state.input_pos.clone()))
        (eager_kv, eager_tokens, eager_pos), (kv, tokens, pos) = results
        for got, expected in zip(kv, eager_kv, strict=True):
            torch.testing.assert_close(got, expected)
        assert torch.equal(tokens, eager_tokens) and torch.equal(pos, eager_pos)


def test_padded_prefill_then_decoding_gives_the_eager_tokens(model):
    """Decoding after a padded prefill overwrites the padding's cache entries before any query sees them."""

    def padded_prefill(model, idx, sampling):
        padding = torch.full((idx.shape[0], 64 - idx.shape[1]), 7)
        prefill_padded(model, torch.cat((idx, padding), dim=1), torch.tensor([idx.shape[1]]), sampling)

    eager = make_steps("none")
    padded_steps = Steps(padded_prefill, eager.decode, eager.mode)
    result = generate(model, PROMPT, max_new_tokens=30, sampling=GREEDY, steps=padded_steps)
    assert result.tokens == greedy(model).tokens


def test_prefill_graphs_only_in_the_cuda_graph_modes():
    assert isinstance(make_steps("reduce-overhead").prefill, GraphedPrefill)
    assert isinstance(make_steps("max-autotune").prefill, GraphedPrefill)
    assert make_steps("default").prefill is prefill
    assert make_steps("reduce-overhead", graph_prefill=False).prefill is prefill
    assert isinstance(make_steps("reduce-overhead", compile_prefill=True).prefill, GraphedPrefill)
    assert not isinstance(make_steps("default", compile_prefill=True).prefill, GraphedPrefill)


def test_graphed_prefill_prefills_eagerly_off_cuda(model):
    graphed, eager = GraphedPrefill(), make_steps("none")
    steps = Steps(graphed, eager.decode, eager.mode)
    result = generate(model, PROMPT, max_new_tokens=10, sampling=GREEDY, steps=steps)
    assert result.tokens == greedy(model, max_new_tokens=10).tokens
    assert not graphed.graphs


def test_stops_at_a_stop_token_and_keeps_it(model):
    tokens = greedy(model).tokens[0]
    stop = tokens[7]
    first = tokens.index(stop)
    result = greedy(model, stop_ids=[stop])
    assert result.tokens == [tokens[: first + 1]]


def test_batch_rows_agree_under_greedy(model):
    result = greedy(model, batch_size=3)
    assert result.tokens == greedy(model).tokens * 3


def test_batch_stops_when_every_row_has_stopped(model):
    torch.manual_seed(0)
    sampled = generate(
        model,
        PROMPT,
        max_new_tokens=40,
        sampling=SamplingConfig(temperature=1.0, top_k=4),
        steps=make_steps("none"),
        batch_size=4,
        stop_ids=[7, 11],
    )
    for row in sampled.tokens:
        assert all(t not in (7, 11) for t in row[:-1])
        assert len(row) == 40 or row[-1] in (7, 11)


def test_callback_sees_every_token_in_order(model):
    seen = []
    result = greedy(model, on_tokens=lambda step: seen.append(step[0]))
    assert seen == result.tokens[0]


def test_same_seed_same_samples(model):
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(generate(model, PROMPT, max_new_tokens=20, sampling=sampling, steps=make_steps("none")).tokens)
    assert runs[0] == runs[1]


def test_timings_are_positive(model):
    result = greedy(model, max_new_tokens=5)
    assert 0 < result.ttft_seconds <= result.seconds
    assert result.new_tokens == 5


def test_cache_length_rounds_up_within_the_context():
    assert cache_length(5, 200, 4096) == 256
    assert cache_length(100, 150, 256) == 256
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):
        cache_length(100, 157, 256)


@pytest.mark.parametrize("mode", ["none", "default", "reduce-overhead", "max-autotune"])
def test_compile_modes_are_accepted(mode):
    assert make_steps(mode).mode == mode


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune"])
def test_compile_options_are_inductor_settings(mode):
    options = compile_options(mode)
    known = torch._inductor.config.get_config_copy()
    assert all(key in known for key in options)
    assert options.get("triton.enable_pdl", False) == options.get("triton.cudagraphs", False)
    assert options.get("triton.cudagraphs", False) == (mode != "default")


@pytest.mark.parametrize(("tuning", "coordinate_descent"), [("coordinate-descent", True), ("heuristic", False)])
def test_kernel_tuning_reaches_every_compiled_step(monkeypatch, tuning, coordinate_descent):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(kwargs["options"]) or fn)
    make_steps("reduce-overhead", compile_prefill=True, tuning=tuning)
    assert len(compiled) == 4  # the decode step and its masked form; the prefill, padded (captured) and not
    assert all(options["coordinate_descent_tuning"] is coordinate_descent for options in compiled)


def test_unknown_kernel_tuning():
    with pytest.raises(ValueError, match="kernel tuning 'slow' is not one of coordinate-descent, heuristic"):
        make_steps("default", tuning="slow")


def test_unknown_compile_mode():
    with pytest.raises(ValueError, match="not one of none, default, reduce-overhead, max-autotune"):
        make_steps("fast")


def test_bad_requests(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy(model, max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], max_new_tokens=3, sampling=GREEDY, steps=make_steps("none"))


@pytest.mark.parametrize(
    ("hits", "misses", "label"), [(3, 0, "warm"), (0, 3, "cold"), (0, 0, "cold"), (1, 2, "partly warm")]
)
def test_compile_cache_labels(hits, misses, label):
    assert CompileCacheUse(hits, misses).label == label


def test_regionally_compiled_greedy_equals_eager(model):
    torch._dynamo.reset()
    model.regional_compile = True
    try:
        compiled = generate(model, PROMPT, max_new_tokens=30, sampling=GREEDY, steps=make_steps("default"))
    finally:
        model.regional_compile = False
    assert compiled.tokens == greedy(model).tokens
