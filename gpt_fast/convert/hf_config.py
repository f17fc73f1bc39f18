"""Reading a Hugging Face ``config.json`` of the Llama family into a :class:`ModelConfig`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from gpt_fast.config import ModelConfig, RopeScaling

# Architecture names (config.json "architectures", else "model_type") this converter reads exactly.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # Llama 2/3/3.1/3.2, CodeLlama, open_llama, TinyLlama, SmolLM/SmolLM2
    "MistralForCausalLM": "mistral",
}
SUPPORTED_MODEL_TYPES = set(SUPPORTED_ARCHITECTURES.values())
_REQUIRED = object()
# The kinds of value a field may be asked to hold, named as the error message says them.
INT, NUMBER, BOOL, STR, OBJECT, STRINGS = (
    "a positive integer",
    "a finite number",
    "true or false",
    "a string",
    "an object",
    "a list of strings",
)
_KINDS: dict[str, Callable[[Any], bool]] = {
    INT: lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    BOOL: lambda v: isinstance(v, bool),
    STR: lambda v: isinstance(v, str),
    OBJECT: lambda v: isinstance(v, dict),
    STRINGS: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
}


def _field(hf: dict[str, Any], name: str, where: str, kind: str, default: Any = _REQUIRED) -> Any:
    """Field ``name`` of a JSON object, which must be ``kind`` (one of ``_KINDS``); absent or null, ``default``
    (an error without one). Nothing is converted: ``"false"`` is not a bool and ``"64"`` is not a number."""
    value = hf.get(name)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{where}: missing field {name}")
        return default
    if not _KINDS[kind](value):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ValueError(f"{where}: field {name} has the wrong type ({shown}; it must be {kind})")
    return value


def architecture(hf: dict[str, Any], where: str) -> str:
    """The checkpoint's architecture as it names itself; a clear error for any other family."""
    names = _field(hf, "architectures", where, STRINGS, [])
    if names:
        name = names[0]
        if name not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{where}: unsupported architecture {name} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return name
    model_type = _field(hf, "model_type", where, STR, None)
    if model_type is None:
        raise ValueError(f'{where}: names no architecture (neither "architectures" nor "model_type")')
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{where}: unsupported architecture {model_type} (supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )
    return model_type


def rope_settings(hf: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """rope base and scaling from either the transformers-4 fields (rope_theta, rope_scaling) or the
    transformers-5 ``rope_parameters`` object."""
    params = _field(hf, "rope_parameters", where, OBJECT, {})
    scaling = _field(hf, "rope_scaling", where, OBJECT, None)
    scaling_where = f"{where}: rope_scaling" if scaling is not None else f"{where}: rope_parameters"
    scaling = params if scaling is None else scaling
    base = _field(params, "rope_theta", f"{where}: rope_parameters", NUMBER, None)
    base = _field(hf, "rope_theta", where, NUMBER, 10000.0) if base is None else base
    kind = _field(scaling, "rope_type", scaling_where, STR, None) or _field(
        scaling, "type", scaling_where, STR, "default"
    )
    if kind == "default":
        return float(base), None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"{where}: unsupported rope scaling type {kind!r} (supported: linear, llama3)")
    keys = (
        ("factor",)
        if kind == "linear"
        else ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    missing = [k for k in keys if scaling.get(k) is None]
    if missing:
        raise ValueError(f"{where}: rope scaling {kind!r} lacks {', '.join(missing)}")
    values = {
        k: _field(scaling, k, scaling_where, INT if k == "original_max_position_embeddings" else NUMBER) for k in keys
    }
    try:
        return float(base), RopeScaling(kind=kind, **values)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


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
    """Map a Llama/Mistral config.json onto our ModelConfig, refusing features our model does not implement and
    fields of the wrong JSON type."""
    architecture(hf, where)
    hidden_act = _field(hf, "hidden_act", where, STR, "silu")
    if hidden_act != "silu":
        raise ValueError(f"{where}: unsupported hidden_act {hidden_act!r} (only silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if _field(hf, flag, where, BOOL, False):
            raise ValueError(f"{where}: unsupported {flag}=true")
    dim = _field(hf, "hidden_size", where, INT)
    n_head = _field(hf, "num_attention_heads", where, INT)
    block_size = _field(hf, "max_position_embeddings", where, INT)
    window = _field(hf, "sliding_window", where, INT, None)
    if window is not None and window < block_size:
        # Attention limited to the window equals full attention for sequences that fit in it.
        block_size = window
    rope_base, rope_scaling = rope_settings(hf, where)
    fields = {
        "block_size": block_size,
        "vocab_size": _field(hf, "vocab_size", where, INT),
        "n_layer": _field(hf, "num_hidden_layers", where, INT),
        "n_head": n_head,
        "dim": dim,
        "intermediate_size": _field(hf, "intermediate_size", where, INT),
        "n_local_heads": _field(hf, "num_key_value_heads", where, INT, n_head),
        "head_dim": _field(hf, "head_dim", where, INT, dim // n_head),
        "rope_base": rope_base,
        "norm_eps": float(_field(hf, "rms_norm_eps", where, NUMBER)),
        "tie_embeddings": _field(hf, "tie_word_embeddings", where, BOOL, False),
        "rope_scaling": rope_scaling,
    }
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
