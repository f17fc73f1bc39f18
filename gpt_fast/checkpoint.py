"""Loading a converted checkpoint (``model.pth`` + ``config.json``) into a :class:`Transformer`, and the checks
every weights file goes through (the converters' inputs too)."""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path

import torch

from gpt_fast.config import CheckpointConfig, ModelConfig, load_checkpoint_config
from gpt_fast.fileio import first_line
from gpt_fast.model import Transformer, weight_shapes
from gpt_fast.tokenizer import load_tokenizer

Shape = tuple[int, ...]


def check_shapes(found: Mapping[str, Shape], expected: Mapping[str, Shape], where: str) -> None:
    """Raise ValueError listing every missing and unexpected tensor name, then the first shape that disagrees."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensor(s): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensor(s): {', '.join(unexpected)}")
    if problems:
        raise ValueError(f"{where}: {'; '.join(problems)}")
    for name, shape in expected.items():
        if tuple(found[name]) != tuple(shape):
            raise ValueError(f"{where}: tensor {name} has shape {list(found[name])}, config.json expects {list(shape)}")


def load_torch_weights(path: Path, mmap: bool = True) -> dict[str, torch.Tensor]:
    """A ``torch.save``'d dict of tensors, read with ``weights_only=True`` (a pickle that would build anything but
    tensors is refused before it runs); memory-mapped when ``mmap`` and the file's format allow it."""
    if not path.is_file():
        raise FileNotFoundError(f"missing weights file {path}")
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError as err:
            if not mmap or "mmap" not in str(err):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path}: unsafe pickle refused, it holds more than tensors ({first_line(err)})") from None
    except (RuntimeError, EOFError, OSError) as err:
        raise ValueError(f"{path} is not a readable weights file: {first_line(err)}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise ValueError(f"{path} does not hold a dict of tensors")
    return state


def load_model(checkpoint_dir: Path, config: CheckpointConfig, device: torch.device, dtype: torch.dtype) -> Transformer:
    """Build the model ``config`` describes and load its weights file onto ``device`` in ``dtype``."""
    weights_path = checkpoint_dir / config.weights
    # Memory-mapping saves a copy when the weights move to a GPU; on the CPU, computing from a private
    # file mapping was measured 8x slower than from ordinary memory (SmolLM2-135M decode), so read it in.
    state = load_torch_weights(weights_path, mmap=device.type != "cpu")
    check_shapes({name: tuple(t.shape) for name, t in state.items()}, weight_shapes(config.model), str(weights_path))
    return model_from_state(config.model, state, device, dtype)


def check_checkpoint(checkpoint_dir: Path) -> CheckpointConfig:
    """Read a checkpoint folder as `generate` does, short of building the model: its config, its tokenizer, and its
    weights' names and shapes (memory-mapped, nothing copied); raise what loading it would raise. The converter
    runs this on its staged result, so every check added to loading also guards what is written."""
    config = load_checkpoint_config(checkpoint_dir)
    load_tokenizer(checkpoint_dir, config.tokenizer)
    weights_path = Path(checkpoint_dir) / config.weights
    state = load_torch_weights(weights_path, mmap=True)
    check_shapes({name: tuple(t.shape) for name, t in state.items()}, weight_shapes(config.model), str(weights_path))
    return config


def model_from_state(
    config: ModelConfig, state: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> Transformer:
    """The model for ``config`` holding ``state``'s tensors (no copy where they already have ``device`` and
    ``dtype``), ready for inference."""
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(state, assign=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
