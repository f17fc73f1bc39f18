"""`gpt-fast quantize`: a converted checkpoint -> a new, quantized checkpoint folder (and the step `convert
--quantize` adds to a conversion).

The source's weights are read memory-mapped and checked as `generate` checks them; each linear layer ``quant``
names is quantized in float32 (on ``device``: a GPU does a 7B model in seconds), and the result is written
through the converter's writer, so the folder appears whole or not at all and is loaded back with the loader's
own checks first. ``config.json`` records the scheme; nothing else marks a quantized checkpoint.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from gpt_fast.checkpoint import check_finite, checkpoint_weights
from gpt_fast.config import CONFIG_FILE, CheckpointConfig, QuantConfig, load_checkpoint_config
from gpt_fast.convert.writer import check_checkpoint_output, target_dir, write_checkpoint
from gpt_fast.device import DTYPES
from gpt_fast.fileio import inside_folder
from gpt_fast.quant.layout import quantize_state


def quantized_config(config: CheckpointConfig, quant: QuantConfig, where: str) -> CheckpointConfig:
    """``config`` with ``quant`` recorded; a model the scheme does not fit is refused, naming ``where``."""
    try:
        return dataclasses.replace(config, quantization=quant)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def quantize_checkpoint(
    checkpoint_dir: Path, out_dir: Path, quant: QuantConfig, device: str | torch.device = "cpu"
) -> Path:
    """Write the quantized copy of the checkpoint in ``checkpoint_dir`` into ``out_dir``; return its weights path."""
    config = load_checkpoint_config(checkpoint_dir)
    where = str(checkpoint_dir / CONFIG_FILE)
    if config.quantization is not None:
        raise ValueError(
            f"{where}: the checkpoint is already quantized ({config.quantization.name}); quantize the checkpoint it "
            "was made from"
        )
    if target_dir(out_dir) == checkpoint_dir.resolve():
        raise ValueError(f"the output folder must differ from the checkpoint being quantized ({checkpoint_dir})")
    result = quantized_config(config, quant, where)
    result = dataclasses.replace(
        result, source={"kind": "quantized", "path": str(checkpoint_dir), "from": config.source}
    )
    check_checkpoint_output(out_dir)
    weights = inside_folder(checkpoint_dir, config.weights, f"{where}: weights")
    state = checkpoint_weights(weights, config)
    check_finite(state, str(weights))
    quantized = quantize_state(state, config.model, quant, DTYPES[config.dtype], device)
    quantized = {name: tensor.cpu() for name, tensor in quantized.items()}
    tokenizer = inside_folder(checkpoint_dir, config.tokenizer.file, f"{where}: tokenizer.file")

    def prepare(stage: Path) -> CheckpointConfig:
        (stage / config.tokenizer.file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer, stage / config.tokenizer.file)
        return result

    write_checkpoint(out_dir, quantized, prepare)
    return out_dir / result.weights
