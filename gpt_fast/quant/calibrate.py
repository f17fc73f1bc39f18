"""Calibration for GPTQ: the text, the token batch, and one forward pass of the float model that quantizes each
linear layer as its inputs arrive.

The default calibration text is the docstrings of a fixed list of standard-library modules
(:data:`CALIBRATION_MODULES`, with their public classes, methods and functions), which ship with every CPython like
the evaluation's default text, ``pydoc_data.topics``, but are not that text: the topics are the language
reference's chapters, written in reST under ``Doc/`` and never a docstring, so perplexity is never measured on
the text the weights were fitted to. ``--calibration_text FILE`` takes any other text.

The calibration rows go through the model in one batch, and each layer to quantize has a hook that runs before it
(``register_forward_pre_hook``): it sees the layer's inputs for every calibration token at once, computes their
Hessian, rounds the layer's weights with GPTQ and puts the dequantized weights in place before the layer
computes. So every layer is calibrated on the outputs of the layers before it *as quantized* (GPTQ's sequential
order, within a block too), in a single pass, with one layer's Hessian in memory at a time.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from gpt_fast.config import ModelConfig, QuantConfig
from gpt_fast.model import Transformer
from gpt_fast.quant.gptq import DAMP, gptq_int4, hessian
from gpt_fast.quant.layout import OUTPUT, quantized_linears
from gpt_fast.quant.schemes import dequantize_int4

CALIBRATION_MODULES = (
    "argparse", "collections", "configparser", "csv", "dataclasses", "datetime", "difflib", "email.message",
    "fractions", "functools", "heapq", "http.client", "ipaddress", "json", "logging", "pathlib", "pickle",
    "random", "shutil", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "enum",
    "unittest", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip
DEFAULT_TEXT = "stdlib docstrings (gpt_fast.quant.calibrate.CALIBRATION_MODULES)"
DEFAULT_TOKENS = 4096
ROW_TOKENS = 512  # tokens per calibration row (each row is a contiguous span of the text)


@dataclass(frozen=True)
class Calibration:
    """How GPTQ is calibrated: the text (None: :func:`stdlib_docstrings`) and what to call it, how many of its
    tokens, act-order, the damping of the Hessian."""

    text: str | None = None
    text_name: str = DEFAULT_TEXT
    tokens: int = DEFAULT_TOKENS
    act_order: bool = False
    damp: float = DAMP

    def __post_init__(self) -> None:
        whole_rows = (
            isinstance(self.tokens, int) and not isinstance(self.tokens, bool) and self.tokens % ROW_TOKENS == 0
        )
        if not whole_rows or self.tokens < ROW_TOKENS:
            raise ValueError(f"--calibration_tokens must be a positive multiple of {ROW_TOKENS}, got {self.tokens!r}")
        if not 0 < self.damp < 1:
            raise ValueError(f"the GPTQ damping must be between 0 and 1, got {self.damp!r}")

    def describe(self) -> dict:
        """What ``config.json`` records of it, under ``source.calibration``."""
        return {"text": self.text_name, "tokens": self.tokens, "act_order": self.act_order, "damp": self.damp}

    def content(self) -> str:
        return stdlib_docstrings() if self.text is None else self.text


def stdlib_docstrings() -> str:
    """The docstrings of :data:`CALIBRATION_MODULES`: each module's, then those of its public classes (and their
    public methods) and functions in the order of their names."""
    texts: list[str] = []
    for module_name in CALIBRATION_MODULES:
        module = importlib.import_module(module_name)
        texts.append(inspect.cleandoc(module.__doc__ or ""))
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            members = sorted(vars(obj).items()) if inspect.isclass(obj) else ()
            for doc in [obj.__doc__] + [m.__doc__ for n, m in members if not n.startswith("_")]:
                if isinstance(doc, str) and doc.strip():
                    texts.append(inspect.cleandoc(doc))
    return "\n\n".join(text for text in dict.fromkeys(texts) if text)


def calibration_rows(ids: list[int], tokens: int, block_size: int, where: str) -> torch.Tensor:
    """``tokens`` of ``ids`` as rows [tokens // T, T] of ``T = min(ROW_TOKENS, block_size)`` tokens: contiguous
    spans spread evenly over the whole text, so that a long text is sampled from end to end."""
    if len(ids) < tokens:
        raise ValueError(f"{where} has {len(ids)} tokens, fewer than the {tokens} to calibrate on")
    length = min(ROW_TOKENS, block_size)
    starts = torch.linspace(0, len(ids) - length, tokens // length).long()
    table = torch.tensor(ids, dtype=torch.long)
    return torch.stack([table[start : start + length] for start in starts.tolist()])


def gptq_parts(
    model: Transformer,
    rows: torch.Tensor,
    config: ModelConfig,
    quant: QuantConfig,
    dtype: torch.dtype,
    calibration: Calibration,
) -> dict[str, dict[str, torch.Tensor]]:
    """``prefix -> {"weight", "scales", "zeros"}`` of every layer ``quant`` quantizes, rounded by GPTQ on
    ``rows`` [B, T] of token ids going through the float32 ``model`` (whose quantized layers are left holding
    their dequantized weights); scales and zeros in ``dtype``."""
    parts: dict[str, dict[str, torch.Tensor]] = {}

    def quantize(prefix: str, weight: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        packed, scales, zeros = gptq_int4(
            weight, hessian(inputs), quant.group_size, dtype, calibration.act_order, calibration.damp
        )
        parts[prefix] = {"weight": packed, "scales": scales, "zeros": zeros}
        return dequantize_int4(packed, scales, zeros, quant.group_size)

    def before(prefix: str, module: nn.Linear, args: tuple) -> None:
        module.weight = nn.Parameter(quantize(prefix, module.weight, args[0]), requires_grad=False)

    def head(module: nn.Module, args: tuple, hidden: torch.Tensor) -> None:
        source = model.tok_embeddings.weight if config.tie_embeddings else model.output.weight
        quantize(OUTPUT, source, model.norm(hidden))

    hooks = [
        model.get_submodule(prefix).register_forward_pre_hook(lambda m, a, p=prefix: before(p, m, a))
        for prefix in quantized_linears(config, quant)
        if prefix != OUTPUT
    ]
    if quant.output:  # the output projection's inputs: the final norm of the last layer's outputs, every position
        hooks.append(model.layers[-1].register_forward_hook(head))
    try:
        batch, length = rows.shape
        device = model.tok_embeddings.weight.device
        model.setup_caches(batch, length)
        with torch.no_grad():
            model(rows.to(device), torch.arange(length, device=device), last_only=True)
    finally:
        for hook in hooks:
            hook.remove()
    return parts
