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

from gpt_fast.checkpoint.load import check_finite, checkpoint_tokenizer, checkpoint_weights, model_from_state
from gpt_fast.convert.writer import check_checkpoint_output, target_dir, write_checkpoint
from gpt_fast.model.config import CONFIG_FILE, CheckpointConfig, QuantConfig, load_checkpoint_config
from gpt_fast.quant.calibrate import Calibration, calibration_rows, gptq_parts
from gpt_fast.quant.layout import quantize_state
from gpt_fast.util.device import DTYPES
from gpt_fast.util.fileio import inside_folder


def quantized_config(config: CheckpointConfig, quant: QuantConfig, where: str) -> CheckpointConfig:
    """``config`` with ``quant`` recorded; a model the scheme does not fit is refused, naming ``where``."""
    try:
        return dataclasses.replace(config, quantization=quant)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def quantize_checkpoint(
    checkpoint_dir: Path,
    out_dir: Path,
    quant: QuantConfig,
    device: str | torch.device = "cpu",
    calibration: Calibration | None = None,
) -> Path:
    """Write the quantized copy of the checkpoint in ``checkpoint_dir`` into ``out_dir``; return its weights path.
    ``quant.method`` ``gptq`` calibrates as ``calibration`` says (default: :class:`Calibration`'s defaults)."""
    if quant.method == "gptq":
        calibration = calibration or Calibration()
    elif calibration is not None:
        raise ValueError("calibration options go with --calibrate gptq")
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
    source = {"kind": "quantized", "path": str(checkpoint_dir), "from": config.source}
    if calibration is not None:
        source["calibration"] = calibration.describe()
    result = dataclasses.replace(result, source=source)
    check_checkpoint_output(out_dir)
    weights = inside_folder(checkpoint_dir, config.weights, f"{where}: weights")
    state = checkpoint_weights(weights, config)
    check_finite(state, str(weights))
    given = None if calibration is None else calibrate(checkpoint_dir, config, state, quant, device, calibration)
    quantized = quantize_state(state, config.model, quant, DTYPES[config.dtype], device, given)
    quantized = {name: tensor.cpu() for name, tensor in quantized.items()}
    tokenizer = inside_folder(checkpoint_dir, config.tokenizer.file, f"{where}: tokenizer.file")

    def prepare(stage: Path) -> CheckpointConfig:
        (stage / config.tokenizer.file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer, stage / config.tokenizer.file)
        return result

    write_checkpoint(out_dir, quantized, prepare)
    return out_dir / result.weights


def calibrate(
    checkpoint_dir: Path,
    config: CheckpointConfig,
    state: dict[str, torch.Tensor],
    quant: QuantConfig,
    device: str | torch.device,
    calibration: Calibration,
) -> dict[str, dict[str, torch.Tensor]]:
    """The GPTQ-rounded tensors of every layer ``quant`` quantizes, the checkpoint's own tokenizer encoding the
    calibration text and its model running it in float32 on ``device``."""
    ids = checkpoint_tokenizer(checkpoint_dir, config).encode(calibration.content(), bos=False)
    where = f"the calibration text ({calibration.text_name})"
    rows = calibration_rows(ids, calibration.tokens, config.model.block_size, where)
    model = model_from_state(config.model, state, torch.device(device), torch.float32)
    return gptq_parts(model, rows, config.model, quant, DTYPES[config.dtype], calibration)
