"""Reading a Hugging Face ``config.json`` of the Llama family into a :class:`ModelConfig`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpt_fast.model.config import ModelConfig, RopeScaling


@dataclass(frozen=True)
class Family:
    """What an architecture implies beyond its config.json fields (our model never sees the name, only these)."""

    model_type: str
    implies: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields the architecture fixes
    # Which layers a sliding_window applies to when config.json has no layer_types: "all", "alternate" (Gemma 2:
    # even layers), "pattern" (Gemma 3: all but every sliding_window_pattern-th), "upper" (Qwen: with
    # use_sliding_window, the layers from max_window_layers on)
    sliding: str = "all"
    defaults: dict[str, Any] = field(default_factory=dict)  # transformers' defaults of fields config.json may omit
    experts: tuple[str, str] | None = None  # the fields of the expert count and of each expert's width
    shared_expert: bool = False


GEMMA = {"norm_offset": 1.0, "post_norms": True}
GEMMA_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True}
# Architecture names (config.json "architectures", else "model_type") this converter reads exactly.
FAMILIES = {
    "LlamaForCausalLM": Family("llama"),  # Llama 2/3/3.1/3.2, CodeLlama, open_llama, TinyLlama, SmolLM/SmolLM2
    "MistralForCausalLM": Family("mistral"),
    "Qwen2ForCausalLM": Family("qwen2", {"qkv_bias": True}, "upper"),  # Qwen2, Qwen2.5 (and Coder, Math)
    "Qwen3ForCausalLM": Family("qwen3", {"qk_norm": True}, "upper", {"head_dim": 128}),
    "Gemma2ForCausalLM": Family(
        "gemma2", GEMMA, "alternate", GEMMA_DEFAULTS | {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    ),
    "Gemma3ForCausalLM": Family("gemma3_text", GEMMA | {"qk_norm": True}, "pattern", GEMMA_DEFAULTS),  # text only
    "Phi3ForCausalLM": Family("phi3"),  # Phi-3 and Phi-3.5 mini/medium
    "MixtralForCausalLM": Family(
        "mixtral", {"norm_topk_prob": True}, experts=("num_local_experts", "intermediate_size")
    ),
    "Qwen2MoeForCausalLM": Family(
        "qwen2_moe", {"qkv_bias": True}, "upper", experts=("num_experts", "moe_intermediate_size"), shared_expert=True
    ),
    "Qwen3MoeForCausalLM": Family(
        "qwen3_moe", {"qk_norm": True}, "upper", experts=("num_experts", "moe_intermediate_size")
    ),
}
SUPPORTED_ARCHITECTURES = {name: family.model_type for name, family in FAMILIES.items()}
SUPPORTED_MODEL_TYPES = set(SUPPORTED_ARCHITECTURES.values())
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF hidden_act -> ours
_REQUIRED = object()
# The kinds of value a field may be asked to hold, named as the error message says them.
INT, NUMBER, BOOL, STR, OBJECT, STRINGS, LIST = (
    "a positive integer",
    "a finite number",
    "true or false",
    "a string",
    "an object",
    "a list of strings",
    "a list",
)
_KINDS: dict[str, Callable[[Any], bool]] = {
    INT: lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
    NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    BOOL: lambda v: isinstance(v, bool),
    STR: lambda v: isinstance(v, str),
    OBJECT: lambda v: isinstance(v, dict),
    STRINGS: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    LIST: lambda v: isinstance(v, list),
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


def architecture_name(hf: dict[str, Any], where: str) -> str:
    """The checkpoint's architecture as a key of :data:`FAMILIES` (a config naming only its model_type too)."""
    name = architecture(hf, where)
    return name if name in FAMILIES else next(n for n, f in FAMILIES.items() if f.model_type == name)


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
    partial = _field(scaling, "partial_rotary_factor", scaling_where, NUMBER, None)
    partial = _field(hf, "partial_rotary_factor", where, NUMBER, 1.0) if partial is None else partial
    if partial != 1.0:
        raise ValueError(f"{where}: unsupported partial_rotary_factor {partial} (only 1.0: rotary on whole heads)")
    if kind == "default":
        return float(base), None
    if kind in ("longrope", "su"):
        return float(base), longrope(hf, scaling, where, scaling_where)
    if kind not in ("linear", "llama3"):
        raise ValueError(f"{where}: unsupported rope scaling type {kind!r} (supported: linear, llama3, longrope)")
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
    return float(base), _rope_scaling(where, kind=kind, **values)


def _rope_scaling(where: str, **values: Any) -> RopeScaling:
    try:
        return RopeScaling(**values)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def longrope(hf: dict[str, Any], scaling: dict[str, Any], where: str, scaling_where: str) -> RopeScaling:
    """Phi-3's ``longrope`` (``su``) scaling, its attention factor computed as transformers does when absent."""
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = scaling.get(name)
        if not isinstance(values, list) or not all(_KINDS[NUMBER](v) for v in values):
            raise ValueError(f"{scaling_where}: {name} must be a list of finite numbers")
        factors[name] = tuple(float(v) for v in values)
    original = _field(scaling, "original_max_position_embeddings", scaling_where, INT, None)
    original = original or _field(hf, "original_max_position_embeddings", where, INT)
    factor = _field(scaling, "factor", scaling_where, NUMBER, None)
    factor = _field(hf, "max_position_embeddings", where, INT) / original if factor is None else factor
    attention = _field(scaling, "attention_factor", scaling_where, NUMBER, None)
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return _rope_scaling(
        where,
        kind="longrope",
        original_max_position_embeddings=original,
        attention_factor=float(attention),
        **factors,
    )


def gemma3_rope(hf: dict[str, Any], where: str) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3's two rotary settings: the full layers' (base and scaling) and the sliding layers' base, from
    transformers 5's ``rope_parameters`` per layer type or transformers 4's ``rope_local_base_freq``."""
    params = _field(hf, "rope_parameters", where, OBJECT, {})
    if "full_attention" in params:
        full = _field(params, "full_attention", f"{where}: rope_parameters", OBJECT)
        local = _field(params, "sliding_attention", f"{where}: rope_parameters", OBJECT, {})
        base, scaling = rope_settings({"rope_parameters": full}, where)
        local_base, local_scaling = rope_settings({"rope_parameters": local}, where)
        if local_scaling is not None:
            raise ValueError(f"{where}: unsupported rope scaling on the sliding layers")
        return base, scaling, local_base
    base, scaling = rope_settings(hf, where)
    return base, scaling, float(_field(hf, "rope_local_base_freq", where, NUMBER, 10000.0))


def hf_architecture(model: ModelConfig) -> str:
    """The transformers architecture whose features ``model`` has (for building reference models)."""
    if model.is_moe:
        if model.shared_expert_size:
            return "Qwen2MoeForCausalLM"
        return "Qwen3MoeForCausalLM" if model.qk_norm else "MixtralForCausalLM"
    if model.post_norms:
        return "Gemma3ForCausalLM" if model.qk_norm else "Gemma2ForCausalLM"
    if model.qk_norm or model.qkv_bias:
        return "Qwen3ForCausalLM" if model.qk_norm else "Qwen2ForCausalLM"
    if model.rope_scaling is not None and model.rope_scaling.kind == "longrope":
        return "Phi3ForCausalLM"
    return "MistralForCausalLM" if model.sliding_window else "LlamaForCausalLM"


def hf_config_dict(model: ModelConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` fields of a model with this shape and features: the inverse of
    :func:`model_config_from_hf`, for building reference models in tests and benchmarks."""
    name = hf_architecture(model)
    family = FAMILIES[name]
    config = {
        "architectures": [name],
        "model_type": family.model_type,
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
        "hidden_act": next(hf for hf, ours in ACTIVATIONS.items() if ours == model.mlp_activation),
    }
    if model.sliding_window is not None:
        config |= {"sliding_window": model.sliding_window, "layer_types": list(model.layer_types)}
    if family.sliding == "upper":
        config["use_sliding_window"] = model.sliding_window is not None
    if model.post_norms:
        config |= {
            "hidden_activation": config["hidden_act"],
            "query_pre_attn_scalar": _integral(model.query_pre_attn_scalar),
            "attn_logit_softcapping": model.attn_logit_softcap,
            "final_logit_softcapping": model.final_logit_softcap,
        }
    if model.rope_local_base is not None:
        config["rope_local_base_freq"] = model.rope_local_base
    if family.experts:
        count, width = family.experts
        config |= {
            count: model.n_experts,
            width: model.intermediate_size,
            "num_experts_per_tok": model.n_active_experts,
        }
        config |= {"norm_topk_prob": model.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": []}
    if model.shared_expert_size:
        config["shared_expert_intermediate_size"] = model.shared_expert_size
    return config | hf_rope_dict(model)


def _integral(value: float | None) -> float | int | None:
    """An integral number as an int (transformers' configs type some such fields int)."""
    return int(value) if value is not None and value.is_integer() else value


def hf_rope_dict(model: ModelConfig) -> dict[str, Any]:
    scaling = model.rope_scaling
    if scaling is None:
        return {}
    if scaling.kind == "divisors":
        raise ValueError("per-frequency rope divisors have no Hugging Face config equivalent")
    if scaling.kind == "longrope":
        keys = ("short_factor", "long_factor", "attention_factor", "original_max_position_embeddings")
        values = {k: list(v) if isinstance(v, tuple) else v for k in keys for v in [getattr(scaling, k)]}
        return {
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "rope_scaling": {"rope_type": "longrope", **values},
        }
    keys = (
        ("factor",)
        if scaling.kind == "linear"
        else ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    return {"rope_scaling": {"rope_type": scaling.kind, **{k: getattr(scaling, k) for k in keys}}}


def _optional_number(hf: dict[str, Any], name: str, where: str, default: float | None) -> float | None:
    """A number that may be null (feature off); absent, ``default``."""
    if name not in hf:
        return default
    value = _field(hf, name, where, NUMBER, None)
    if value is not None and value <= 0:
        raise ValueError(f"{where}: field {name} must be > 0, got {value!r}")
    return None if value is None else float(value)


def layer_types(hf: dict[str, Any], family: Family, where: str, n_layer: int) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window and each layer's type; ``(None, ())`` when no layer slides over less than the
    context (a window that covers it is full attention) and the sliding layers differ in nothing else."""
    if family.sliding == "upper" and not _field(hf, "use_sliding_window", where, BOOL, False):
        return None, ()  # Qwen: sliding_window is ignored (Qwen2-MoE writes 0 there)
    window = _field(hf, "sliding_window", where, INT, None)
    given = _field(hf, "layer_types", where, STRINGS, None)
    if given is not None:
        if len(given) != n_layer:
            raise ValueError(f"{where}: layer_types holds {len(given)} values, num_hidden_layers is {n_layer}")
        kinds = tuple(given)
    elif family.sliding == "alternate":
        kinds = tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer))
    elif family.sliding == "pattern":
        pattern = _field(hf, "sliding_window_pattern", where, INT, 6)
        kinds = tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layer))
    elif family.sliding == "upper":
        first = _field(hf, "max_window_layers", where, INT, 28)
        kinds = tuple("sliding_attention" if i >= first else "full_attention" for i in range(n_layer))
    else:
        kinds = ("sliding_attention",) * n_layer
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"{where}: unsupported layer type {unknown[0]!r} in layer_types")
    covers = window is not None and window >= _field(hf, "max_position_embeddings", where, INT)
    if window is None or "sliding_attention" not in kinds or (covers and family.sliding != "pattern"):
        return None, ()  # (Gemma 3's sliding layers stay: they have their own rotary base)
    return window, kinds


def refuse_unsupported(hf: dict[str, Any], family: Family, where: str) -> str:
    """Refuse the features our model does not implement; return the MLP's activation."""
    act = _field(hf, "hidden_activation", where, STR, None) or _field(hf, "hidden_act", where, STR, "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{where}: unsupported hidden_act {act!r} (supported: {', '.join(ACTIVATIONS)})")
    for flag in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
        if _field(hf, flag, where, BOOL, False):
            raise ValueError(f"{where}: unsupported {flag}=true")
    if family.experts:
        if _field(hf, "decoder_sparse_step", where, INT, 1) != 1 or _field(hf, "mlp_only_layers", where, LIST, []):
            raise ValueError(
                f"{where}: unsupported dense MLP layers among the experts (decoder_sparse_step, mlp_only_layers)"
            )
    return ACTIVATIONS[act]


def model_config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """Map a config.json of a supported architecture onto our ModelConfig, refusing features our model does not
    implement and fields of the wrong JSON type."""
    family = FAMILIES[architecture_name(hf, where)]
    hf = family.defaults | hf
    activation = refuse_unsupported(hf, family, where)
    dim = _field(hf, "hidden_size", where, INT)
    n_head = _field(hf, "num_attention_heads", where, INT)
    n_layer = _field(hf, "num_hidden_layers", where, INT)
    window, kinds = layer_types(hf, family, where, n_layer)
    if family.sliding == "pattern":
        rope_base, rope_scaling, local_base = gemma3_rope(hf, where)
    else:
        (rope_base, rope_scaling), local_base = rope_settings(hf, where), None
    fields = {
        "block_size": _field(hf, "max_position_embeddings", where, INT),
        "vocab_size": _field(hf, "vocab_size", where, INT),
        "n_layer": n_layer,
        "n_head": n_head,
        "dim": dim,
        "intermediate_size": _field(hf, "intermediate_size", where, INT),
        "n_local_heads": _field(hf, "num_key_value_heads", where, INT, n_head),
        "head_dim": _field(hf, "head_dim", where, INT, dim // n_head),
        "rope_base": rope_base,
        "norm_eps": float(_field(hf, "rms_norm_eps", where, NUMBER)),
        "tie_embeddings": _field(hf, "tie_word_embeddings", where, BOOL, False),
        "rope_scaling": rope_scaling,
        "mlp_activation": activation,
        "sliding_window": window,
        "layer_types": kinds,
        "rope_local_base": local_base if window is not None else None,
        "qkv_bias": _field(hf, "qkv_bias", where, BOOL, False),
        **family.implies,
    }
    if family.implies.get("norm_offset"):  # Gemma
        fields |= {
            "embedding_scale": math.sqrt(dim),
            "query_pre_attn_scalar": _optional_number(hf, "query_pre_attn_scalar", where, None),
            "attn_logit_softcap": _optional_number(hf, "attn_logit_softcapping", where, None),
            "final_logit_softcap": _optional_number(hf, "final_logit_softcapping", where, None),
        }
    if family.experts:
        fields |= expert_fields(hf, family, where)
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def expert_fields(hf: dict[str, Any], family: Family, where: str) -> dict[str, Any]:
    count, width = family.experts
    if count not in hf:  # transformers 5 writes Qwen3-MoE's num_experts under its alias num_local_experts
        count = "num_local_experts"
    fields = {
        "n_experts": _field(hf, count, where, INT),
        "intermediate_size": _field(hf, width, where, INT),
        "n_active_experts": _field(hf, "num_experts_per_tok", where, INT),
        "norm_topk_prob": family.implies.get("norm_topk_prob", _field(hf, "norm_topk_prob", where, BOOL, False)),
    }
    if family.shared_expert:
        fields["shared_expert_size"] = _field(hf, "shared_expert_intermediate_size", where, INT)
    return fields
