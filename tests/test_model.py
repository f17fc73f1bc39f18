import pytest
import torch

from gpt_fast.model.cache import BlockTable, KVCache, PagedKVCache
from gpt_fast.model.config import ModelConfig, RopeScaling
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import (
    Transformer,
    attend_one_query,
    rope_inv_freq,
    weight_bytes_per_token,
    weight_shapes,
)


def tiny_model(n_local_heads: int, tie: bool = False, seed: int = 0, **fields) -> Transformer:
    """A two-layer model of random weights (``fields``: other config values)."""
    torch.manual_seed(seed)
    config = ModelConfig(
        block_size=128,
        vocab_size=97,
        n_head=4,
        dim=32,
        intermediate_size=48,
        n_local_heads=n_local_heads,
        head_dim=8,
        rope_base=10000.0,
        norm_eps=1e-5,
        tie_embeddings=tie,
        **({"n_layer": 2} | fields),
    )
    model = Transformer(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


@pytest.mark.parametrize("n_local_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@torch.no_grad()
def test_cached_decode_matches_full_forward(n_local_heads):
    model = tiny_model(n_local_heads)
    tokens = torch.randint(0, 97, (2, 24))
    model.setup_caches(2, 64)
    full = model(tokens, torch.arange(24))  # [B, T, V]
    model.setup_caches(2, 32)  # a fresh, shorter cache
    steps = [model(tokens[:, :7], torch.arange(7))]
    for pos in range(7, 24):
        steps.append(model(tokens[:, pos : pos + 1], torch.tensor([pos])))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_local_heads", [4, 1], ids=["mha", "mqa"])
@torch.no_grad()
def test_slots_prefilled_apart_and_decoded_together_match_full_forwards(n_local_heads):
    """Three sequences of different lengths, each prefilled alone into its own cache row, then decoded together at
    their own positions (the fourth row idle), give the logits of each sequence's own full forward."""
    model = tiny_model(n_local_heads)
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 97, (1, n), generator=generator) for n in (9, 4, 15)]
    expected = []
    for seq in sequences:
        model.setup_caches(1, 32)
        expected.append(model(seq, torch.arange(seq.shape[1]))[0])  # [T, V]
    model.setup_caches(4, 32)
    prompt = 3  # each sequence's first three tokens are its prompt
    got = [[] for _ in sequences]
    for row, seq in enumerate(sequences):
        got[row].append(model(seq[:, :prompt], torch.arange(prompt), first_row=row)[0])
    for pos in range(prompt, 15):
        rows = [min(pos, seq.shape[1] - 1) for seq in sequences]  # a finished sequence repeats its last position
        tokens = torch.stack([seq[0, p] for seq, p in zip(sequences, rows, strict=True)])[:, None]  # [3, 1]
        logits = model(tokens, torch.tensor(rows)[:, None])  # [3, 1, V]
        for row, seq in enumerate(sequences):
            if pos < seq.shape[1]:
                got[row].append(logits[row])
    for row in range(3):
        torch.testing.assert_close(torch.cat(got[row]), expected[row], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_a_slot_prefill_writes_only_its_own_cache_row():
    model = tiny_model(2)
    model.setup_caches(3, 16)
    cache = model.layers[0].attention.kv_cache.kv
    cache.fill_(7.0)
    model(torch.randint(0, 97, (1, 5)), torch.arange(5), first_row=1)
    changed = (cache != 7.0).any(dim=(0, 2, 4))  # [rows, positions]
    assert changed[1, :5].all() and not changed[1, 5:].any() and not changed[[0, 2]].any()


@torch.no_grad()
@pytest.mark.parametrize("n_kv", [4, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_attention_matches_sdpa(n_kv, dtype):
    generator = torch.Generator().manual_seed(n_kv)
    q = torch.randn(2, 4, 1, 16, generator=generator).to(dtype)
    k, v = (torch.randn(2, n_kv, 24, 16, generator=generator).to(dtype) for _ in range(2))
    shared = torch.where(torch.arange(24) <= 9, 0.0, float("-inf"))[None].to(dtype)  # [1, S]: positions 0..9 filled
    lengths = torch.tensor([4, 20])[:, None, None, None]  # each row's own: [B, 1, 1, S]
    per_row = torch.where(torch.arange(24) < lengths, 0.0, float("-inf")).to(dtype)
    for mask in (shared, per_row):
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask.float(), enable_gqa=n_kv != 4
        )
        got = attend_one_query(q, k, v, mask)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(
            got.float(),
            expected.to(dtype).float(),
            rtol=1e-5 if dtype == torch.float32 else 1e-2,
            atol=1e-5 if dtype == torch.float32 else 1e-2,
        )


@pytest.mark.parametrize(
    "fields",
    [
        {"n_local_heads": 4},
        {"n_local_heads": 2},
        {"n_local_heads": 2, "sliding_window": 4, "layer_types": ("sliding_attention", "full_attention")},
        {"n_local_heads": 2, "attn_logit_softcap": 5.0},
    ],
    ids=["mha", "gqa", "sliding", "softcapped"],
)
@torch.no_grad()
def test_a_prompt_from_the_start_attends_as_through_the_mask(fields):
    """``from_start``: the full-attention layers attend causally over the new keys alone (SDPA's causal path); the
    logits and the cache it leaves are those of attention through the mask over the whole cache."""
    model = tiny_model(**fields)
    tokens = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    results = []
    for from_start in (False, True):
        model.setup_caches(2, 32)
        model.layers[0].attention.kv_cache.kv.normal_()  # stale entries past the prompt: both must ignore them
        logits = model(tokens, torch.arange(11), from_start=from_start)
        results.append((logits, [layer.attention.kv_cache.kv[:, :, :, :11].clone() for layer in model.layers]))
    (masked, masked_cache), (causal, causal_cache) = results
    torch.testing.assert_close(causal, masked, rtol=1e-5, atol=1e-5)
    for got, expected in zip(causal_cache, masked_cache, strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize(
    "fields",
    [{}, {"sliding_window": 4, "layer_types": ("sliding_attention", "full_attention")}],
    ids=["full", "sliding"],
)
@torch.no_grad()
def test_eager_cpu_masks_stop_at_the_last_position_written(paged, fields, monkeypatch):
    """An eager CPU step's masks and gathers cover the cache's positions up to the last one written; its logits are
    those of masks over the whole cache (a compiled step's), for a prompt continued at its own positions and for
    rows decoded together at different positions, in a static cache and in a paged one of shuffled blocks."""

    def run(whole: bool) -> torch.Tensor:
        model = tiny_model(2, **fields)
        if whole:
            monkeypatch.setattr(model, "_keys_seen", lambda input_pos: model.max_seq_length)
        model.setup_caches(2, 64, blocks=12 if paged else None, block_size=8)
        if paged:
            model.block_table.blocks.copy_(torch.tensor([[5, 2, 9, 1, 0, 0, 0, 0], [3, 11, 7, 4, 0, 0, 0, 0]]))
        tokens = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(3))
        steps = [model(tokens[:, :13], torch.arange(13)), model(tokens[:, 13:20], torch.arange(13, 20))]
        for pos in range(20, 29):
            positions = torch.tensor([[pos], [pos - 9]])  # each row at its own position
            steps.append(model(tokens[:, pos : pos + 1], positions))
        return torch.cat(steps, dim=1)

    assert run(False).shape == (2, 29, 97)
    torch.testing.assert_close(run(False), run(True), rtol=1e-5, atol=1e-5)


def test_last_only_returns_last_position():
    model = tiny_model(2)
    tokens = torch.randint(0, 97, (1, 10))
    model.setup_caches(1, 16)
    full = model(tokens, torch.arange(10))
    last = model(tokens, torch.arange(10), last_only=True)
    assert last.shape == (1, 1, 97)
    torch.testing.assert_close(last[:, 0], full[:, -1])


@torch.no_grad()
def test_last_index_returns_that_position():
    model = tiny_model(2)
    tokens = torch.randint(0, 97, (2, 10))
    model.setup_caches(2, 16)
    full = model(tokens, torch.arange(10))
    picked = model(tokens, torch.arange(10), last_index=torch.tensor([6]))
    assert picked.shape == (2, 1, 97)
    torch.testing.assert_close(picked[:, 0], full[:, 6])
    each = model(tokens, torch.arange(10), last_index=torch.tensor([3, 9]))  # each row's own position
    torch.testing.assert_close(each[:, 0], torch.stack((full[0, 3], full[1, 9])))


@torch.no_grad()
def test_setup_caches_grows_for_a_longer_request():
    model = tiny_model(2)
    model.setup_caches(1, 8)
    assert model.layers[0].attention.kv_cache.kv.shape == (2, 1, 2, 8, 8)
    model.setup_caches(3, 40)
    assert model.layers[0].attention.kv_cache.kv.shape == (2, 3, 2, 40, 8)
    assert model.rope_cos.shape == (40, 4)
    logits = model(torch.randint(0, 97, (3, 33)), torch.arange(33))
    assert torch.isfinite(logits).all()


@torch.no_grad()
def test_a_cache_of_its_own_dtype_holds_rounded_keys_and_gives_float32_attention():
    """``kv_dtype_name`` float16 (``--kv_cache_dtype``): the cache is allocated anew in it, holds the keys and values
    rounded to it, and the logits are those of the float32 cache within that rounding; static and paged alike."""
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))

    def logits(model: Transformer, blocks: int | None) -> torch.Tensor:
        model.setup_caches(2, 24, blocks=blocks, block_size=4)
        if blocks is not None:  # each row's own 6 blocks
            model.block_table.blocks.copy_(torch.arange(1, 13).view(2, 6))
        return model(tokens, torch.arange(12))

    for blocks in (None, 13):
        model = tiny_model(2)
        wide, cache = logits(model, blocks), model.layers[0].attention.kv_cache
        model.kv_dtype_name = "float16"
        narrow, narrow_cache = logits(model, blocks), model.layers[0].attention.kv_cache
        assert narrow_cache is not cache and narrow_cache.kv.dtype == torch.float16 and narrow.dtype == torch.float32
        keys, _ = narrow_cache.update(torch.tensor([12]), *[torch.zeros(2, 2, 1, 8)] * 2, length=12)
        assert keys.dtype == torch.float32
        torch.testing.assert_close(keys, keys.half().float(), rtol=0, atol=0)
        torch.testing.assert_close(narrow, wide, rtol=1e-2, atol=1e-2)


@torch.no_grad()
@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("rows_apart", [False, True], ids=["same-position", "own-positions"])
def test_a_float8_cache_holds_keys_rounded_to_it_and_clamped(paged, rows_apart):
    """A float8 e4m3fn cache (``--kv_cache_dtype float8_e4m3fn``) is written through its bytes (the CPU has no
    float8 ``index_copy_``) with every write path: all rows at one position, rows at their own, paged blocks. What
    it holds is torch's own rounding of the keys and values, a value past the largest float8 (448) the largest
    rather than NaN; it reads back in the model's dtype."""
    f8 = torch.float8_e4m3fn
    k = torch.randn(2, 2, 1, 8, generator=torch.Generator().manual_seed(5)) * 3
    v = torch.randn(2, 2, 1, 8, generator=torch.Generator().manual_seed(6))
    k[0, 0, 0, :2] = torch.tensor([1000.0, -3000.0])
    if paged:
        table = BlockTable(2, 16, 4, device="cpu")
        table.blocks.copy_(torch.tensor([[3, 1, 2, 4], [5, 6, 7, 8]]))
        cache = PagedKVCache(9, table, 2, 8, dtype=f8, device="cpu")
    else:
        cache = KVCache(2, 2, 16, 8, dtype=f8, device="cpu")
    input_pos = torch.tensor([[6], [9]]) if rows_apart else torch.tensor([6])
    keys, values = cache.update(input_pos, k, v)  # [2, 2, 16, 8] each, float32
    expected_k = k.clamp(-448, 448).to(f8).float()
    for row, position in enumerate([6, 9] if rows_apart else [6, 6]):
        torch.testing.assert_close(keys[row, :, position], expected_k[row, :, 0], rtol=0, atol=0)
        torch.testing.assert_close(values[row, :, position], v[row, :, 0].to(f8).float(), rtol=0, atol=0)
    assert keys.dtype == torch.float32 and keys[0, 0, 6, :2].tolist() == [448.0, -448.0]
    assert torch.isfinite(cache.kv.float()).all() and (keys != 0).sum() == k.numel()


@torch.no_grad()
def test_a_float8_cache_gives_the_logits_of_a_full_one_within_its_rounding():
    """The tiny model prefilling over a float8 cache (static and paged) against a float32 cache: its 3-bit mantissa
    moves the logits by a few per cent of their spread, not more."""
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    for blocks in (None, 13):
        model = tiny_model(2)
        model.setup_caches(2, 24, blocks=blocks, block_size=4)
        if blocks is not None:
            model.block_table.blocks.copy_(torch.arange(1, 13).view(2, 6))
        wide = model(tokens, torch.arange(12))
        model.kv_dtype_name = "float8_e4m3fn"
        model.setup_caches(2, 24, blocks=blocks, block_size=4)
        if blocks is not None:
            model.block_table.blocks.copy_(torch.arange(1, 13).view(2, 6))
        narrow = model(tokens, torch.arange(12))
        assert model.layers[0].attention.kv_cache.kv.dtype == torch.float8_e4m3fn
        error = ((narrow - wide).norm() / wide.norm()).item()
        assert 0 < error < 0.05, error


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        RopeScaling(kind="linear", factor=4.0),
        RopeScaling(
            kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        ),
    ],
)
def test_rope_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": 500000.0}
    if scaling is not None:
        params = {"rope_type": scaling.kind, "rope_theta": 500000.0, "factor": scaling.factor}
        if scaling.kind == "llama3":
            params |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf_config = LlamaConfig(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=1024, rope_parameters=params
    )
    if scaling is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_config)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[scaling.kind](hf_config, "cpu")
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, scaling), expected)


def test_divisor_scaling_divides_inverse_frequencies():
    divisors = tuple(float(i + 1) for i in range(4))
    plain = rope_inv_freq(8, 10000.0, None)
    torch.testing.assert_close(
        rope_inv_freq(8, 10000.0, RopeScaling(kind="divisors", divisors=divisors)), plain / torch.tensor(divisors)
    )


def test_weight_shapes_use_fused_projections():
    shapes = weight_shapes(get_shape("llama-3-8b"))
    assert shapes["layers.0.attention.wqkv.weight"] == (4096 + 2 * 1024, 4096)
    assert shapes["layers.0.feed_forward.w13.weight"] == (2 * 14336, 4096)
    assert "output.weight" in shapes
    assert "output.weight" not in weight_shapes(get_shape("smollm2-135m"))


def test_bytes_per_token_excludes_the_embedding_table_unless_tied():
    untied, tied = tiny_model(2), tiny_model(2, tie=True)
    table = 97 * 32 * 4
    assert weight_bytes_per_token(untied) == sum(p.numel() * 4 for p in untied.parameters()) - table
    assert weight_bytes_per_token(tied) == sum(p.numel() * 4 for p in tied.parameters())


@pytest.mark.parametrize("regional", [True, False], ids=["regional", "whole"])
@torch.no_grad()
def test_regional_compile_traces_one_region_for_the_layers(regional):
    layer_types = ("sliding_attention", "full_attention") * 2
    model = tiny_model(2, n_layer=4, sliding_window=4, layer_types=layer_types)
    model.setup_caches(1, 16)
    model.regional_compile = regional
    graphs = []

    def capture(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    tokens, positions = torch.tensor([[3, 1, 4, 1, 5, 9]]), torch.arange(6)
    compiled = torch.compile(model, backend=capture, fullgraph=True)(tokens, positions, from_start=True)
    torch.testing.assert_close(compiled, model(tokens, positions, from_start=True), rtol=1e-5, atol=1e-5)
    (graph,) = graphs
    calls = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    regions = {n.args[0].target for n in calls}
    assert (len(calls), len(regions) < len(layer_types)) == ((4, True) if regional else (0, True))
