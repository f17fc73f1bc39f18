"""Checkpoint configuration: frozen dataclasses stored as ``config.json`` next to the weights.

The converter writes ``config.json``; everything that loads a checkpoint reads it back with
:func:`load_checkpoint_config`. Nothing here looks at a directory or file name to decide what a model is.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpt_fast.fileio import read_json_object, regular_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.pth"
FORMAT_NAME = "gpt-fast-checkpoint"
FORMAT_VERSION = 1
ROPE_SCALING_KINDS = ("llama3", "linear", "divisors")
TOKENIZER_KINDS = ("sentencepiece", "tiktoken", "huggingface")
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")  # what a weights file may hold (gpt_fast.device.DTYPES)
QUANT_MODES = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
# Upper bound of every size in a model config (context, vocabulary, widths, layers, heads): 16M, far above any
# real model (Llama 3.1 405B: 126 layers, width 16384) and small enough that products of sizes stay exact.
MAX_SIZE = 1 << 24


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling: ``linear``, Llama 3.1's ``llama3``, or explicit per-frequency
    ``divisors`` of the inverse frequencies (how GGUF files store Llama 3.1's scaling)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    divisors: tuple[float, ...] | None = None

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


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. Field names follow the gpt-fast blog's printed config."""

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
        divisors = self.rope_scaling.divisors if self.rope_scaling else None
        _require(
            divisors is None or len(divisors) == self.head_dim // 2,
            f"model.rope_scaling.divisors must hold head_dim / 2 = {self.head_dim // 2} values",
        )

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
class QuantConfig:
    """Weight-only quantization of a checkpoint's linear layers (the four projections of every layer, and the
    output projection when ``output`` is true). ``int8``: one symmetric scale per output channel. ``int4``:
    groups of ``group_size`` consecutive input columns, each with its own scale and zero point. Embeddings, norms,
    scales and zero points stay in the checkpoint's ``dtype``."""

    mode: str
    group_size: int | None = None  # int4 only
    output: bool = False

    def __post_init__(self) -> None:
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

    def check_model(self, model: ModelConfig) -> None:
        """Refuse a model whose layers this scheme cannot store."""
        if self.mode != "int4":
            return
        for name in ("dim", "intermediate_size"):  # the input widths of the quantized layers (q_size is even)
            size = getattr(model, name)
            _require(size % 2 == 0, f"int4 quantization packs two input columns per byte: model.{name} ({size}) is odd")

    @property
    def name(self) -> str:
        """``int8``, ``int4-g128``: as reports name the scheme."""
        return self.mode if self.group_size is None else f"{self.mode}-g{self.group_size}"


@dataclass(frozen=True)
class CheckpointConfig:
    """Everything ``config.json`` holds: the model shape, the tokenizer, the chat template, the weights' dtype and
    their quantization (None: none)."""

    model: ModelConfig
    tokenizer: TokenizerConfig
    dtype: str  # dtype of the tensors in the weights file, e.g. "bfloat16"
    chat_template: str | None = None
    weights: str = WEIGHTS_FILE
    source: dict[str, Any] = field(default_factory=dict)  # provenance only (what it was converted from)
    quantization: QuantConfig | None = None

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
