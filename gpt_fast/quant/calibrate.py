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

Asymmetric calibration (:func:`gpt_fast.quant.gptq.asymmetric_target`) also needs each layer's inputs in the float
model, for the same tokens. They are computed a block ahead (:class:`FloatReference`): before a transformer block
runs on the partly quantized model's hidden state, it runs, still float, on the float model's, and its layers'
inputs are kept until each is quantized. One block's float inputs are in memory at a time, and the float model
costs one more pass through each block, not a copy of the model.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from gpt_fast.model.config import ModelConfig, QuantConfig
from gpt_fast.model.transformer import Transformer
from gpt_fast.quant.gptq import DAMP, asymmetric_target, gptq_int4, hessian
from gpt_fast.quant.layout import OUTPUT, quantized_linears
from gpt_fast.quant.schemes import dequantize_int4
from gpt_fast.util.choices import CALIBRATION_TEXT, CALIBRATION_TOKENS

CALIBRATION_MODULES = (
    "argparse", "collections", "configparser", "csv", "dataclasses", "datetime", "difflib", "email.message",
    "fractions", "functools", "heapq", "http.client", "ipaddress", "json", "logging", "pathlib", "pickle",
    "random", "shutil", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "enum",
    "unittest", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip
DEFAULT_TEXT = CALIBRATION_TEXT
DEFAULT_TOKENS = CALIBRATION_TOKENS
ROW_TOKENS = 512  # tokens per calibration row (each row is a contiguous span of the text)


@dataclass(frozen=True)
class Calibration:
    """How GPTQ is calibrated: the text (None: :func:`stdlib_docstrings`) and what to call it, how many of its
    tokens, act-order, the damping of the Hessian, asymmetric calibration (against the float model's outputs).
    The defaults are ``gpt-fast quantize --mode int4``'s: act-order and asymmetric calibration on, the recipe of
    least perplexity measured on the default model (docs/bench/2026-11-28_quant_int4_default_cpu.txt)."""

    text: str | None = None
    text_name: str = DEFAULT_TEXT
    tokens: int = DEFAULT_TOKENS
    act_order: bool = True
    damp: float = DAMP
    asymmetric: bool = True

    def __post_init__(self) -> None:
        whole_rows = (
            isinstance(self.tokens, int) and not isinstance(self.tokens, bool) and self.tokens % ROW_TOKENS == 0
        )
        if not whole_rows or self.tokens < ROW_TOKENS:
            raise ValueError(f"--calibration_tokens must be a positive multiple of {ROW_TOKENS}, got {self.tokens!r}")
        if not 0 < self.damp < 1:
            raise ValueError(f"the GPTQ damping must be between 0 and 1, got {self.damp!r}")
        if not isinstance(self.asymmetric, bool):
            raise ValueError(f"asymmetric calibration is on or off (a bool), got {self.asymmetric!r}")

    def describe(self) -> dict:
        """What ``config.json`` records of it, under ``source.calibration``."""
        return {
            "text": self.text_name,
            "tokens": self.tokens,
            "act_order": self.act_order,
            "damp": self.damp,
            "asymmetric": self.asymmetric,
        }

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


class FloatReference:
    """The float model a block ahead of the partly quantized one, for asymmetric calibration: :meth:`advance`, each
    block's forward pre-hook, runs the block (its layers still float) on the float model's hidden state first,
    while :attr:`recording` tells its layers' hooks to keep their inputs in :attr:`inputs` rather than quantize."""

    def __init__(self) -> None:
        self.hidden: torch.Tensor | None = None  # the float model's hidden state after the blocks run so far
        self.inputs: dict[str, torch.Tensor] = {}
        self.recording = False

    def advance(self, block: nn.Module, args: tuple) -> None:
        """``args`` are the block's arguments in the quantized model's pass; their hidden state is the float
        model's too before the first block (the embeddings are never quantized)."""
        self.recording = True
        try:  # forward, not a call: the block's hooks (this one, the head's) are for the quantized pass
            self.hidden = block.forward(args[0] if self.hidden is None else self.hidden, *args[1:])
        finally:
            self.recording = False


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
    reference = FloatReference() if calibration.asymmetric else None

    def quantize(
        prefix: str, weight: torch.Tensor, inputs: torch.Tensor, float_inputs: torch.Tensor | None
    ) -> torch.Tensor:
        if float_inputs is not None:
            weight = asymmetric_target(weight, float_inputs, inputs)
        packed, scales, zeros = gptq_int4(
            weight, hessian(inputs), quant.group_size, dtype, calibration.act_order, calibration.damp
        )
        parts[prefix] = {"weight": packed, "scales": scales, "zeros": zeros}
        return dequantize_int4(packed, scales, zeros, quant.group_size)

    def before(prefix: str, module: nn.Linear, args: tuple) -> None:
        if reference is not None and reference.recording:
            reference.inputs[prefix] = args[0]
            return
        float_inputs = None if reference is None else reference.inputs.pop(prefix)
        module.weight = nn.Parameter(quantize(prefix, module.weight, args[0], float_inputs), requires_grad=False)

    def head(module: nn.Module, args: tuple, hidden: torch.Tensor) -> None:
        source = model.tok_embeddings.weight if config.tie_embeddings else model.output.weight
        quantize(OUTPUT, source, model.norm(hidden), None if reference is None else model.norm(reference.hidden))

    hooks = [
        model.get_submodule(prefix).register_forward_pre_hook(lambda m, a, p=prefix: before(p, m, a))
        for prefix in quantized_linears(config, quant)
        if prefix != OUTPUT
    ]
    if quant.output:  # the output projection's inputs: the final norm of the last layer's outputs, every position
        hooks.append(model.layers[-1].register_forward_hook(head))
    if reference is not None:
        hooks += [layer.register_forward_pre_hook(reference.advance) for layer in model.layers]
    try:
        batch, length = rows.shape
        device = model.norm.weight.device
        model.setup_caches(batch, length)
        with torch.no_grad():
            model(rows.to(device), torch.arange(length, device=device), last_only=True)
    finally:
        for hook in hooks:
            hook.remove()
    return parts
