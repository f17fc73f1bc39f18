"""Checkpoint configuration: frozen dataclasses stored as ``config.json`` next to the weights.

The converter writes ``config.json``; everything that loads a checkpoint reads it back with
:func:`load_checkpoint_config`. Nothing here looks at a directory or file name to decide what a model is.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpt_fast.util.fileio import read_json_object, regular_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.pth"
FORMAT_NAME = "gpt-fast-checkpoint"
FORMAT_VERSION = 1
ROPE_SCALING_KINDS = ("llama3", "linear", "divisors", "longrope")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU (Llama), GeGLU with tanh-approximated GeLU (Gemma)
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names
MAX_EXPERTS = 1024  # far above any released mixture of experts (Qwen3-MoE: 128, DeepSeek-V3: 256)
TOKENIZER_KINDS = ("sentencepiece", "tiktoken", "huggingface")
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")  # what a weights file may hold (gpt_fast.util.device.DTYPES)
QUANT_MODES = ("int8", "int4")
QUANT_KERNELS = ("auto", "triton", "gemlite", "cpp", "cpp-q8", "aten", "dequant")  # gpt_fast.quant.products
INT4_GROUP_SIZES = (32, 64, 128, 256)
TABLE_MODES = ("int8",)  # how quantization.embeddings may store a tied embedding table
QUANT_METHODS = ("rtn", "gptq")  # round-to-nearest (data-free), GPTQ (calibrated; int4 only)
# The linear layers a scheme quantizes, by name; ``quantization.keep_float`` names some of them to keep in float.
QUANTIZABLE_LINEAR = re.compile(r"layers\.(\d+)\.(attention\.(wqkv|wo)|feed_forward\.(w13|w2))")
# Upper bound of every size in a model config (context, vocabulary, widths, layers, heads): 16M, far above any
# real model (Llama 3.1 405B: 126 layers, width 16384) and small enough that products of sizes stay exact.
MAX_SIZE = 1 << 24


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling: ``linear``, Llama 3.1's ``llama3``, explicit per-frequency
    ``divisors`` of the inverse frequencies (how GGUF files store Llama 3.1's scaling), or Phi-3's ``longrope``
    (per-frequency ``short_factor`` divisors within ``original_max_position_embeddings``, ``long_factor`` beyond,
    and cos/sin multiplied by ``attention_factor``)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    divisors: tuple[float, ...] | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"rope_scaling.kind {self.kind!r} is not one of {', '.join(ROPE_SCALING_KINDS)}")
        _require_positive_number(self.factor, "rope_scaling.factor")
        if self.kind == "llama3":
            for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                _require(getattr(self, name) is not None, f"rope_scaling.{name} is required for kind 'llama3'")
            _require_positive_number(self.low_freq_factor, "rope_scaling.low_freq_factor")
            _require_positive_number(self.high_freq_factor, "rope_scaling.high_freq_factor")
            _require_size(self.original_max_position_embeddings, "rope_scaling.original_max_position_embeddings")
            _require(
                self.high_freq_factor > self.low_freq_factor,
                "rope_scaling.high_freq_factor must exceed low_freq_factor",
            )
        _require(
            (self.kind == "divisors") == (self.divisors is not None),
            "rope_scaling.divisors goes with kind 'divisors' only",
        )
        for i, divisor in enumerate(self.divisors or ()):
            _require_positive_number(divisor, f"rope_scaling.divisors[{i}]")
        longrope = self.kind == "longrope"
        if longrope:
            for name in ("short_factor", "long_factor", "attention_factor", "original_max_position_embeddings"):
                _require(getattr(self, name) is not None, f"rope_scaling.{name} is required for kind 'longrope'")
            _require_size(self.original_max_position_embeddings, "rope_scaling.original_max_position_embeddings")
            _require_positive_number(self.attention_factor, "rope_scaling.attention_factor")
            _require(
                len(self.short_factor) == len(self.long_factor),
                "rope_scaling: short_factor and long_factor differ in length",
            )
        _require(
            longrope or (self.short_factor, self.long_factor, self.attention_factor) == (None, None, None),
            "rope_scaling.short_factor, long_factor and attention_factor go with kind 'longrope' only",
        )
        for name in ("short_factor", "long_factor"):
            for i, factor in enumerate(getattr(self, name) or ()):
                _require_positive_number(factor, f"rope_scaling.{name}[{i}]")

    def frequency_divisors(self) -> tuple[float, ...] | None:
        """The per-frequency divisors, whose count must be head_dim / 2 (None for the kinds without them)."""
        return self.divisors or self.short_factor


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder. Field names up to ``rope_scaling`` follow the gpt-fast blog's printed config; the fields
    after them are the features other families add, each off by default (a config.json written before they
    existed reads as the Llama it describes). A family is a set of these values, never a name."""

    block_size: int  # the model's context length
    vocab_size: int
    n_layer: int
    n_head: int
    dim: int
    intermediate_size: int
    n_local_heads: int  # key/value heads (== n_head for multi-head, fewer for grouped-query attention)
    head_dim: int
    rope_base: float
    norm_eps: float
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotary embedding (Qwen3, Gemma 3)
    norm_offset: float = 0.0  # every RMSNorm multiplies by (norm_offset + weight), in float32 (Gemma: 1)
    mlp_activation: str = "silu"  # one of MLP_ACTIVATIONS, applied to the gate projection
    embedding_scale: float = 1.0  # embeddings are multiplied by it, rounded to the model's dtype (Gemma: sqrt(dim))
    post_norms: bool = False  # RMSNorm on the attention's and the MLP's outputs too (Gemma 2 and 3)
    attn_logit_softcap: float | None = None  # attention scores s become cap * tanh(s / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # likewise for the output logits (Gemma 2)
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power, not head_dim's
    sliding_window: int | None = None  # a sliding layer attends to the keys less than this far back
    layer_types: tuple[str, ...] = ()  # one of LAYER_TYPES per layer; empty: every layer full_attention
    rope_local_base: float | None = None  # the rotary base of sliding layers, unscaled (Gemma 3); None: rope_base
    n_experts: int = 0  # experts per MLP (0: a dense MLP); each expert's hidden width is intermediate_size
    n_active_experts: int = 0  # experts each token is routed to (top-k)
    norm_topk_prob: bool = True  # the chosen experts' router probabilities renormalized to sum to 1
    shared_expert_size: int = 0  # hidden width of an always-active expert gated by sigmoid (Qwen2-MoE); 0: none

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "vocab_size",
            "n_layer",
            "n_head",
            "dim",
            "intermediate_size",
            "n_local_heads",
            "head_dim",
        ):
            _require_size(getattr(self, name), f"model.{name}")
        _require(
            self.n_head % self.n_local_heads == 0,
            f"model.n_head ({self.n_head}) must be a multiple of n_local_heads ({self.n_local_heads})",
        )
        _require(self.head_dim % 2 == 0, f"model.head_dim ({self.head_dim}) must be even for rotary embeddings")
        _require_positive_number(self.rope_base, "model.rope_base")
        _require_positive_number(self.norm_eps, "model.norm_eps")
        _require(
            isinstance(self.tie_embeddings, bool), f"model.tie_embeddings must be a bool, got {self.tie_embeddings!r}"
        )
        divisors = self.rope_scaling.frequency_divisors() if self.rope_scaling else None
        _require(
            divisors is None or len(divisors) == self.head_dim // 2,
            f"model.rope_scaling's per-frequency factors must hold head_dim / 2 = {self.head_dim // 2} values",
        )
        self._check_features()

    def _check_features(self) -> None:
        for name in ("qkv_bias", "qk_norm", "post_norms", "norm_topk_prob"):
            _require(isinstance(getattr(self, name), bool), f"model.{name} must be a bool, got {getattr(self, name)!r}")
        _require(
            self.mlp_activation in MLP_ACTIVATIONS,
            f"model.mlp_activation {self.mlp_activation!r} is not one of {', '.join(MLP_ACTIVATIONS)}",
        )
        _require_finite(self.norm_offset, "model.norm_offset")
        _require_positive_number(self.embedding_scale, "model.embedding_scale")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "rope_local_base"):
            if getattr(self, name) is not None:
                _require_positive_number(getattr(self, name), f"model.{name}")
        _require(
            not self.layer_types or len(self.layer_types) == self.n_layer,
            f"model.layer_types must be empty or hold n_layer = {self.n_layer} values, not {len(self.layer_types)}",
        )
        for i, kind in enumerate(self.layer_types):
            _require(kind in LAYER_TYPES, f"model.layer_types[{i}] {kind!r} is not one of {', '.join(LAYER_TYPES)}")
        sliding = "sliding_attention" in self.layer_types
        if self.sliding_window is not None:
            _require_size(self.sliding_window, "model.sliding_window")
        _require(
            sliding == (self.sliding_window is not None),
            "model.sliding_window must be set exactly when layer_types names a sliding_attention layer",
        )
        _require(self.rope_local_base is None or sliding, "model.rope_local_base needs a sliding_attention layer")
        self._check_experts()

    def _check_experts(self) -> None:
        for name in ("n_experts", "n_active_experts", "shared_expert_size"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SIZE,
                f"model.{name} must be an integer from 0 to {MAX_SIZE}, got {value!r}",
            )
        _require(self.n_experts <= MAX_EXPERTS, f"model.n_experts ({self.n_experts}) must be at most {MAX_EXPERTS}")
        if self.n_experts == 0:
            _require(
                self.n_active_experts == 0 and self.shared_expert_size == 0,
                "model.n_active_experts and shared_expert_size need n_experts > 0",
            )
        else:
            _require(
                1 <= self.n_active_experts <= self.n_experts,
                f"model.n_active_experts must be from 1 to n_experts ({self.n_experts}), got {self.n_active_experts}",
            )

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def layer_type(self, layer: int) -> str:
        """``full_attention`` or ``sliding_attention``."""
        return self.layer_types[layer] if self.layer_types else "full_attention"

    @property
    def q_size(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_local_heads * self.head_dim


@dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer a checkpoint uses and its special tokens, as recorded at conversion time."""

    kind: str  # one of TOKENIZER_KINDS
    file: str  # relative to the checkpoint folder
    bos_id: int | None
    add_bos: bool  # whether encoding a prompt starts with bos_id
    stop_ids: tuple[int, ...]  # generation ends at any of these (EOS, end-of-turn, ...)
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens: dict[str, int] = field(default_factory=dict)  # text of each special token -> id
    pattern: str | None = None  # pre-tokenizer regex (tiktoken only)

    def __post_init__(self) -> None:
        if self.kind not in TOKENIZER_KINDS:
            raise ValueError(f"tokenizer.kind {self.kind!r} is not one of {', '.join(TOKENIZER_KINDS)}")
        _require_inside(self.file, "tokenizer.file")
        _require(not (self.add_bos and self.bos_id is None), "tokenizer.add_bos is true but tokenizer.bos_id is null")
        _require(self.kind != "tiktoken" or bool(self.pattern), "tokenizer.pattern is required for kind 'tiktoken'")
        object.__setattr__(self, "stop_ids", tuple(self.stop_ids))

    def token_ids(self) -> dict[str, int]:
        """Every token id the config names, by field: bos_id, stop_ids[i], special_tokens[text]."""
        ids = {} if self.bos_id is None else {"bos_id": self.bos_id}
        ids |= {f"stop_ids[{i}]": token_id for i, token_id in enumerate(self.stop_ids)}
        return ids | {f"special_tokens[{text!r}]": token_id for text, token_id in self.special_tokens.items()}


@dataclass(frozen=True)
class EmbeddingQuant:
    """How a tied embedding table, which is also the output projection, is stored (``quantization.embeddings``):
    ``int8`` symmetric, one scale per row, or with ``group_size`` one scale per group of that many consecutive
    columns (the form of a GGUF's ``Q8_0`` blocks, groups of 32). The lookup and the output projection read the
    same tensors."""

    mode: str = "int8"
    group_size: int | None = None

    def __post_init__(self) -> None:
        modes = ", ".join(TABLE_MODES)
        _require(self.mode in TABLE_MODES, f"quantization.embeddings.mode {self.mode!r} is not one of {modes}")
        sizes = ", ".join(map(str, INT4_GROUP_SIZES))
        _require(
            self.group_size is None or self.group_size in INT4_GROUP_SIZES,
            f"quantization.embeddings.group_size must be null or one of {sizes}, got {self.group_size!r}",
        )

    @property
    def name(self) -> str:
        """``int8`` or ``int8-g32``."""
        return self.mode if self.group_size is None else f"{self.mode}-g{self.group_size}"


@dataclass(frozen=True)
class QuantConfig:
    """Weight-only quantization of a checkpoint's linear layers (the four projections of every layer, and the
    output projection when ``output`` is true). ``int8``: one symmetric scale per output channel. ``int4``:
    groups of ``group_size`` consecutive input columns, each with its own scale and zero point. Embeddings, norms,
    scales and zero points stay in the checkpoint's ``dtype``, and so do the projections ``keep_float`` names.
    ``method`` records how the integers were chosen (``rtn``: round to nearest; ``gptq``: calibrated, see
    :mod:`gpt_fast.quant.gptq`); the stored tensors and the kernels are the same for every method.
    ``embeddings`` quantizes a tied embedding table in place (:class:`EmbeddingQuant`), read by the lookup and the
    output projection alike; ``output`` instead stores a quantized copy of it apart."""

    mode: str
    group_size: int | None = None  # int4 only
    output: bool = False
    method: str = "rtn"  # how the weights were rounded: provenance; every method stores the same tensors
    keep_float: tuple[str, ...] = ()  # projections left in the checkpoint's dtype ("layers.0.feed_forward.w2")
    embeddings: EmbeddingQuant | None = None  # a tied embedding table quantized in place

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep_float", tuple(self.keep_float))
        _require(
            self.method in QUANT_METHODS,
            f"quantization.method {self.method!r} is not one of {', '.join(QUANT_METHODS)}",
        )
        _require(self.method != "gptq" or self.mode == "int4", "quantization.method gptq goes with int4 only")
        for name in self.keep_float:
            _require(
                isinstance(name, str) and QUANTIZABLE_LINEAR.fullmatch(name) is not None,
                f"quantization.keep_float: {name!r} is not a layer's projection (e.g. layers.0.feed_forward.w2)",
            )
        _require(len(set(self.keep_float)) == len(self.keep_float), "quantization.keep_float names a layer twice")
        _require(self.mode in QUANT_MODES, f"quantization.mode {self.mode!r} is not one of {', '.join(QUANT_MODES)}")
        if self.mode == "int4":
            sizes = ", ".join(map(str, INT4_GROUP_SIZES))
            _require(
                self.group_size in INT4_GROUP_SIZES,
                f"quantization.group_size must be one of {sizes} for int4, got {self.group_size!r}",
            )
        else:
            _require(self.group_size is None, f"quantization.group_size goes with int4 only, got {self.group_size!r}")
        _require(isinstance(self.output, bool), f"quantization.output must be true or false, got {self.output!r}")
        _require(
            not (self.output and self.embeddings is not None),
            "quantization.output and quantization.embeddings exclude each other: a tied table is quantized apart "
            "for the output projection or in place for both",
        )

    def check_model(self, model: ModelConfig) -> None:
        """Refuse a model whose layers this scheme cannot store."""
        _require(
            model.n_experts == 0,
            f"quantization of a mixture of experts is not supported (model.n_experts = {model.n_experts})",
        )
        for name in self.keep_float:
            layer = int(QUANTIZABLE_LINEAR.fullmatch(name).group(1))
            _require(
                layer < model.n_layer,
                f"quantization.keep_float: {name!r} is beyond the model's layers (model.n_layer = {model.n_layer})",
            )
        _require(
            self.embeddings is None or model.tie_embeddings,
            "quantization.embeddings quantizes a tied embedding table, and model.tie_embeddings is false",
        )
        if self.mode != "int4":
            return
        for name in ("dim", "intermediate_size"):  # the input widths of the quantized layers (q_size is even)
            size = getattr(model, name)
            _require(size % 2 == 0, f"int4 quantization packs two input columns per byte: model.{name} ({size}) is odd")

    def as_dict(self) -> dict[str, Any]:
        """The fields as ``config.json`` holds them: ``embeddings`` only when set, so that the other schemes'
        files read as before."""
        fields = dataclasses.asdict(self)
        if self.embeddings is None:
            del fields["embeddings"]
        return fields

    @property
    def name(self) -> str:
        """``int8``, ``int4-g128``, ``int4-g128-gptq``, ``int4-g128-gptq (2 layers in float)``, ``int4-g32,
        embeddings int8-g32``: as reports name the scheme."""
        name = self.mode if self.group_size is None else f"{self.mode}-g{self.group_size}"
        name += "" if self.method == "rtn" else f"-{self.method}"
        name += "" if self.embeddings is None else f", embeddings {self.embeddings.name}"
        return name + (f" ({len(self.keep_float)} layers in float)" if self.keep_float else "")


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling a checkpoint's authors recommend, recorded at conversion (a Hugging Face folder's
    ``generation_config.json``, as transformers and vLLM read it; for the embedded default model, its model card):
    what `generate`, `chat` and :meth:`gpt_fast.engine.engine.Engine.generate` use for each value the user does not
    give. None: no recommendation (gpt-fast's default applies)."""

    temperature: float | None = None
    top_k: int | None = None  # 0: the whole vocabulary (as in generation_config.json)
    top_p: float | None = None
    source: str = ""  # where the values come from, as reports name it

    def __post_init__(self) -> None:
        _require(
            self.temperature is None or (math.isfinite(self.temperature) and self.temperature >= 0),
            f"generation.temperature must be a finite number >= 0, got {self.temperature!r}",
        )
        _require(
            self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= 0),
            f"generation.top_k must be an integer >= 0, got {self.top_k!r}",
        )
        _require(self.top_p is None or 0 < self.top_p <= 1, f"generation.top_p must be in (0, 1], got {self.top_p!r}")

    def given(self) -> dict[str, float | int]:
        """The values recommended, by name."""
        values = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True)
class CheckpointConfig:
    """Everything ``config.json`` holds: the model shape, the tokenizer, the chat template, the weights' dtype,
    their quantization (None: none) and the recommended sampling (None: none recorded, as in checkpoints converted
    before it was)."""

    model: ModelConfig
    tokenizer: TokenizerConfig
    dtype: str  # dtype of the tensors in the weights file, e.g. "bfloat16"
    chat_template: str | None = None
    weights: str = WEIGHTS_FILE
    source: dict[str, Any] = field(default_factory=dict)  # provenance only (what it was converted from)
    quantization: QuantConfig | None = None
    generation: GenerationDefaults | None = None

    def __post_init__(self) -> None:
        _require(self.dtype in WEIGHT_DTYPES, f"dtype {self.dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
        _require_inside(self.weights, "weights")
        vocab = self.model.vocab_size
        for name, token_id in self.tokenizer.token_ids().items():
            _require(
                0 <= token_id < vocab,
                f"tokenizer.{name} = {token_id} is outside the model's vocabulary (model.vocab_size = {vocab})",
            )
        if self.quantization is not None:
            self.quantization.check_model(self.model)

    def to_json(self) -> str:
        payload = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **dataclasses.asdict(self)}
        if self.quantization is not None:
            payload["quantization"] = self.quantization.as_dict()
        return json.dumps(payload, indent=2, ensure_ascii=False) + "\n"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_size(value: Any, name: str) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SIZE,
        f"{name} must be a positive integer (at most {MAX_SIZE}), got {value!r}",
    )


def _require_inside(name: str, field: str) -> None:
    """A file name relative to the checkpoint folder, not leaving it (symbolic links are followed at load)."""
    path = Path(name)
    _require(
        bool(name) and not path.is_absolute() and ".." not in path.parts,
        f"{field} must be a path inside the checkpoint folder, got {name!r}",
    )


def _require_finite(value: Any, name: str) -> None:
    _require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        f"{name} must be a finite number, got {value!r}",
    )


def _require_positive_number(value: Any, name: str) -> None:
    _require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
        f"{name} must be a finite number > 0, got {value!r}",
    )


def _build(cls: type, data: Any, where: str) -> Any:
    """Build dataclass ``cls`` from a JSON object, naming the first unknown, missing or mistyped field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    missing = [
        n
        for n, f in fields.items()
        if n not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    values = {name: _coerce(hints[name], value, f"{where}.{name}") for name, value in data.items()}
    try:
        return cls(**values)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _coerce(hint: Any, value: Any, where: str) -> Any:
    """Check ``value`` against a field's type hint (int, float, bool, str, dataclass, tuple, dict, Optional)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _coerce(inner, value, where)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is tuple:
        _require(isinstance(value, list), f"{where} must be a list")
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis}
        return tuple(_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _require(isinstance(value, dict), f"{where} must be an object")
        key_type, value_type = typing.get_args(hint)
        return (
            {k: _coerce(value_type, v, f"{where}[{k!r}]") for k, v in value.items()}
            if value_type is not Any
            else dict(value)
        )
    if hint is bool:
        _require(isinstance(value, bool), f"{where} must be true or false, got {value!r}")
    elif hint is int:
        _require(isinstance(value, int) and not isinstance(value, bool), f"{where} must be an integer, got {value!r}")
    elif hint is float:
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            f"{where} must be a finite number, got {value!r}",
        )
        return float(value)
    elif hint is str:
        _require(isinstance(value, str), f"{where} must be a string, got {value!r}")
    return value


def checkpoint_config_from_dict(data: Any, where: str = CONFIG_FILE) -> CheckpointConfig:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must hold a JSON object")
    data = dict(data)
    if data.pop("format", None) != FORMAT_NAME:
        raise ValueError(
            f'{where} is not a gpt-fast checkpoint config (no "format": "{FORMAT_NAME}"); convert the checkpoint '
            "with `gpt-fast convert`"
        )
    version = data.pop("format_version", None)
    if version != FORMAT_VERSION:
        raise ValueError(f"{where}: format_version {version!r} is not supported (expected {FORMAT_VERSION})")
    return _build(CheckpointConfig, data, where)


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """Accept the weights file (``…/model.pth``, as in the blog) or its folder; return the folder."""
    path = Path(path)
    if path.is_dir():
        return path
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    return regular_file(path, "checkpoint").parent


def load_checkpoint_config(checkpoint_dir: str | Path) -> CheckpointConfig:
    """Read and validate ``config.json`` from a converted checkpoint folder."""
    config_path = Path(checkpoint_dir) / CONFIG_FILE
    if not config_path.exists():
        raise FileNotFoundError(f"missing {config_path} (convert the checkpoint first: gpt-fast convert SOURCE)")
    return checkpoint_config_from_dict(read_json_object(config_path), str(config_path))
