"""Reading a Hugging Face ``config.json`` of the Llama family into a :class:`ModelConfig`."""

from __future__ import annotations

from typing import Any

from gpt_fast.config import ModelConfig, RopeScaling

# Architecture names (config.json "architectures", else "model_type") this converter reads exactly.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # Llama 2/3/3.1/3.2, CodeLlama, open_llama, TinyLlama, SmolLM/SmolLM2
    "MistralForCausalLM": "mistral",
}
SUPPORTED_MODEL_TYPES = set(SUPPORTED_ARCHITECTURES.values())


def architecture(hf: dict[str, Any], where: str) -> str:
    """The checkpoint's architecture as it names itself; a clear error for any other family."""
    names = hf.get("architectures") or []
    if names:
        name = names[0]
        if name not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{where}: unsupported architecture {name} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return name
    model_type = hf.get("model_type")
    if model_type is None:
        raise ValueError(f'{where}: names no architecture (neither "architectures" nor "model_type")')
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{where}: unsupported architecture {model_type} (supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )
    return model_type


def _field(hf: dict[str, Any], name: str, where: str, kind: type | tuple[type, ...] = int) -> Any:
    if name not in hf or hf[name] is None:
        raise ValueError(f"{where}: missing field {name}")
    value = hf[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{where}: field {name} has the wrong type ({value!r})")
    return value


def rope_settings(hf: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """rope base and scaling from either the transformers-4 fields (rope_theta, rope_scaling) or the
    transformers-5 ``rope_parameters`` object."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not isinstance(base, (int, float)) or isinstance(base, bool):
        raise ValueError(f"{where}: field rope_theta has the wrong type ({base!r})")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(base), None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"{where}: unsupported rope scaling type {kind!r} (supported: linear, llama3)")
    keys = (
        ("factor",)
        if kind == "linear"
        else ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    missing = [k for k in keys if k not in scaling]
    if missing:
        raise ValueError(f"{where}: rope scaling {kind!r} lacks {', '.join(missing)}")
    return float(base), RopeScaling(kind=kind, **{k: scaling[k] for k in keys})


def hf_config_dict(model: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` fields of a Llama with this shape: the inverse of
    :func:`model_config_from_hf`, for building reference models in tests and benchmarks."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": model.vocab_size,
        "hidden_size": model.dim,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.n_layer,
        "num_attention_heads": model.n_head,
        "num_key_value_heads": model.n_local_heads,
        "head_dim": model.head_dim,
        "max_position_embeddings": model.block_size,
        "rope_theta": model.rope_base,
        "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings,
    }
    scaling = model.rope_scaling
    if scaling is None:
        return config
    if scaling.kind == "divisors":
        raise ValueError("per-frequency rope divisors have no Hugging Face config equivalent")
    keys = (
        ("factor",)
        if scaling.kind == "linear"
        else ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    return config | {"rope_scaling": {"rope_type": scaling.kind, **{k: getattr(scaling, k) for k in keys}}}


def model_config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """Map a Llama/Mistral config.json onto our ModelConfig, refusing features our model does not implement."""
    architecture(hf, where)
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: unsupported hidden_act {hf['hidden_act']!r} (only silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"{where}: unsupported {flag}=true")
    dim = _field(hf, "hidden_size", where)
    n_head = _field(hf, "num_attention_heads", where)
    block_size = _field(hf, "max_position_embeddings", where)
    window = hf.get("sliding_window")
    if isinstance(window, int) and window < block_size:
        # Attention limited to the window equals full attention for sequences that fit in it.
        block_size = window
    rope_base, rope_scaling = rope_settings(hf, where)
    head_dim = hf.get("head_dim") or dim // n_head
    try:
        return ModelConfig(
            block_size=block_size,
            vocab_size=_field(hf, "vocab_size", where),
            n_layer=_field(hf, "num_hidden_layers", where),
            n_head=n_head,
            dim=dim,
            intermediate_size=_field(hf, "intermediate_size", where),
            n_local_heads=hf.get("num_key_value_heads") or n_head,
            head_dim=head_dim,
            rope_base=rope_base,
            norm_eps=float(_field(hf, "rms_norm_eps", where, (int, float))),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
        )
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
