"""Model families (Qwen2, Qwen3, Gemma 2 and 3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE): a tiny random checkpoint of
each, built with transformers' own config and model classes, converted from its HF folder, gives transformers'
logits over a prompt and 40 tokens decoded with our KV cache, and the same greedy tokens."""

import dataclasses
import json

import pytest
import torch
from tiny import hf_greedy, our_greedy, train_bpe_tokenizer

from gpt_fast.convert.hf import convert_hf
from gpt_fast.engine.engine import Engine

COMMON = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": None,
}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
# family -> (transformers config class, its arguments beyond COMMON)
FAMILIES = {
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen2-sliding": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {}),
    "gemma2": ("Gemma2Config", {"sliding_window": 8, "query_pre_attn_scalar": 24}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 8, "sliding_window_pattern": 2, "rope_local_base_freq": 100.0}),
    "gemma3-linear-rope": ("Gemma3TextConfig", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "phi3-longrope": ("Phi3Config", {"rope_scaling": LONGROPE, "original_max_position_embeddings": 64}),
    "mistral-sliding": ("MistralConfig", {"sliding_window": 8}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": ("Qwen2MoeConfig", MOE | {"num_experts": 4, "shared_expert_intermediate_size": 48}),
    "qwen3-moe": ("Qwen3MoeConfig", MOE | {"num_experts": 6, "norm_topk_prob": True}),
}
PROMPT = [0, 45, 67, 120, 7, 99, 13, 250, 31, 8, 77, 190, 5, 64, 222, 18, 90, 3, 141, 60]  # longer than the window


def hf_model(family: str, vocab_size: int, seed: int = 0):
    import transformers

    class_name, extra = FAMILIES[family]
    config = getattr(transformers, class_name)(**COMMON, **extra, vocab_size=vocab_size)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger than the default init: well-separated logits, no argmax near-ties
        for name, p in model.named_parameters():
            norm = name.endswith("norm.weight")
            p.normal_(1.0 if norm else 0.0, 0.1 if norm else 0.25)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, tmp_path_factory):
    src = tmp_path_factory.mktemp("hf") / request.param
    tokenizer = train_bpe_tokenizer(src)
    model = hf_model(request.param, tokenizer.get_vocab_size())
    model.save_pretrained(src)
    out = src.parent / f"{request.param}-converted"
    convert_hf(src, out, dtype="float32")
    return model, Engine.load(out, device="cpu", dtype="float32")


@torch.no_grad()
def cached_logits(model, tokens: list[int], prompt_length: int) -> torch.Tensor:
    """Our logits [T, V] for ``tokens``: the prompt in one forward, then one token at a time over the KV cache."""
    ids = torch.tensor([tokens])
    model.setup_caches(1, 64)
    steps = [model(ids[:, :prompt_length], torch.arange(prompt_length))[0]]
    for pos in range(prompt_length, len(tokens)):
        steps.append(model(ids[:, pos : pos + 1], torch.tensor([pos]))[0])
    return torch.cat(steps)


@torch.no_grad()
def test_greedy_decode_and_logits_match_transformers(converted):
    hf, engine = converted
    generated = hf_greedy(hf, PROMPT, 40)
    assert our_greedy(engine, PROMPT, 40) == generated
    tokens = PROMPT + generated
    expected = hf(torch.tensor([tokens])).logits[0]
    diff = (cached_logits(engine.model, tokens, len(PROMPT)) - expected).abs().max().item()
    assert diff < 1e-4


def test_config_names_the_architecture(converted):
    hf, engine = converted
    assert engine.config.source["architecture"] == hf.config.architectures[0]


def convert_family(folder, family: str, tie_experts: bool = False):
    """A tiny random ``family`` checkpoint saved by transformers and converted; with ``tie_experts`` the router
    gives experts 0 and 1 (and 2 and 3) the same logits for every token."""
    tokenizer = train_bpe_tokenizer(folder / "hf")
    model = hf_model(family, tokenizer.get_vocab_size())
    if tie_experts:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight[1::2] = layer.mlp.gate.weight[0::2]
    model.save_pretrained(folder / "hf")
    convert_hf(folder / "hf", folder / "out", dtype="float32")
    return model, folder / "out"


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
@torch.no_grad()
def test_routing_matches_transformers_including_ties(tmp_path, family):
    hf, out = convert_family(tmp_path, family, tie_experts=True)
    engine = Engine.load(out, device="cpu", dtype="float32")
    hidden = torch.randn(50, 64)
    _, hf_weights, hf_ids = hf.model.layers[1].mlp.gate(hidden)
    weights, ids = engine.model.layers[1].feed_forward.route(hidden)
    assert torch.equal(ids, hf_ids)  # the same expert of each tied pair chosen
    assert (hf_weights[:, 0] == hf_weights[:, 1]).any()  # ties did happen among the chosen
    torch.testing.assert_close(weights, hf_weights.float(), rtol=0, atol=0)
    tokens = PROMPT + hf_greedy(hf, PROMPT, 40)
    expected = hf(torch.tensor([tokens])).logits[0]
    assert (cached_logits(engine.model, tokens, len(PROMPT)) - expected).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "mixtral"])
def test_compiled_decode_equals_eager(tmp_path, family):
    """Soft-capping and sliding windows (Gemma 2), the experts' gather (Mixtral) in the compiled decode step."""
    _, out = convert_family(tmp_path, family)
    eager = our_greedy(Engine.load(out, device="cpu", dtype="float32"), PROMPT, 40)
    compiled = Engine.load(out, compile="default", device="cpu", dtype="float32")
    assert our_greedy(compiled, PROMPT, 40) == eager


LLAMA = {
    "block_size": 64,
    "vocab_size": 300,
    "n_layer": 2,
    "n_head": 4,
    "dim": 64,
    "intermediate_size": 96,
    "n_local_heads": 2,
    "head_dim": 16,
    "rope_base": 10000.0,
    "norm_eps": 1e-5,
}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layer_types": ("full_attention",) * 3}, "must be empty or hold n_layer = 2 values, not 3"),
        ({"layer_types": ("full_attention", "local")}, r"layer_types\[1\] 'local' is not one of"),
        ({"layer_types": ("sliding_attention",) * 2}, "sliding_window must be set exactly when"),
        ({"sliding_window": 8}, "sliding_window must be set exactly when"),
        ({"n_experts": 4, "n_active_experts": 5}, r"n_active_experts must be from 1 to n_experts \(4\), got 5"),
        ({"n_active_experts": 2}, "need n_experts > 0"),
        ({"n_experts": 2000, "n_active_experts": 2}, "must be at most 1024"),
        ({"mlp_activation": "relu"}, "mlp_activation 'relu' is not one of silu, gelu_tanh"),
        ({"attn_logit_softcap": -1.0}, "attn_logit_softcap must be a finite number > 0"),
        ({"rope_local_base": 10.0}, "rope_local_base needs a sliding_attention layer"),
    ],
)
def test_features_that_do_not_fit_together_are_refused(fields, message):
    from gpt_fast.model.config import ModelConfig

    with pytest.raises(ValueError, match=message):
        ModelConfig(**LLAMA, **fields)


def test_a_config_without_the_feature_fields_reads_as_llama():
    from gpt_fast.convert.random_init import byte_tokenizer
    from gpt_fast.model.config import ModelConfig, checkpoint_config_from_dict

    _, tokenizer = byte_tokenizer(300)
    data = {"format": "gpt-fast-checkpoint", "format_version": 1, "model": LLAMA, "dtype": "float32"}
    config = checkpoint_config_from_dict(json.loads(json.dumps(data | {"tokenizer": dataclasses.asdict(tokenizer)})))
    assert config.model == ModelConfig(**LLAMA)
    assert not config.model.is_moe and config.model.layer_types == () and config.model.norm_offset == 0.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["Gemma3ForConditionalGeneration"]}, "unsupported architecture Gemma3ForConditional"),
        ({"hidden_act": "gelu"}, r"unsupported hidden_act 'gelu' \(supported: silu, gelu_pytorch_tanh\)"),
        ({"attention_bias": True}, "unsupported attention_bias=true"),
        ({"partial_rotary_factor": 0.5}, "unsupported partial_rotary_factor 0.5"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": "x", "long_factor": []}}, "short_factor must be"),
        (
            {"rope_scaling": LONGROPE | {"short_factor": [1.0]}, "original_max_position_embeddings": 64},
            "short_factor and long_factor differ in length",
        ),
        ({"architectures": ["Qwen2MoeForCausalLM"], "mlp_only_layers": [0]}, "unsupported dense MLP layers"),
    ],
)
def test_unsupported_hf_configs_are_refused(change, message):
    from gpt_fast.convert.hf_config import model_config_from_hf

    hf = {"architectures": ["Phi3ForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
    hf |= COMMON | {"vocab_size": 300, "shared_expert_intermediate_size": 8} | change
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(hf, "config.json")
