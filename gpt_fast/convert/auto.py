"""`gpt-fast convert SOURCE`: a Hugging Face folder or a GGUF file, told apart by what is on disk."""

from __future__ import annotations

import contextlib
from pathlib import Path

from gpt_fast.convert.gguf_file import convert_gguf
from gpt_fast.convert.hf import convert_hf
from gpt_fast.convert.writer import output_lock
from gpt_fast.model.config import QuantConfig
from gpt_fast.util.fileio import regular_file
from gpt_fast.util.paths import CHECKPOINTS_DIR, HF_SUBDIR

GGUF_MAGIC = b"GGUF"


def default_output_dir(source: Path) -> Path:
    """checkpoints/ORG/NAME/hf -> checkpoints/ORG/NAME (the blog's layout); otherwise checkpoints/<name>."""
    if source.is_dir() and source.name == HF_SUBDIR:
        return source.parent
    return CHECKPOINTS_DIR / (source.stem if source.is_file() else source.name)


def is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def convert_source(
    source: Path, output_dir: Path | None = None, dtype: str | None = None, quantization: QuantConfig | None = None
) -> Path:
    """Convert ``source`` (and quantize it, with ``quantization``); return the path of the written ``model.pth``.

    The output folder's lock is held from the start when its parent exists (no folder is made for a mistyped
    source): a second conversion into it waits before reading its source, which may lie inside the folder (``hf/``)
    and is put back there first if an interrupted conversion had carried it aside."""
    out = output_dir if output_dir is not None else default_output_dir(source)
    with output_lock(out) if out.parent.is_dir() else contextlib.nullcontext():
        return convert_source_into(source, out, dtype, quantization)


def convert_source_into(source: Path, out: Path, dtype: str | None, quantization: QuantConfig | None) -> Path:
    if not source.exists():
        raise FileNotFoundError(f"source not found: {source}")
    if source.is_dir():
        return convert_hf(source, out, dtype, quantization)
    if not is_gguf(regular_file(source, "source")):
        raise ValueError(f"{source} is neither a Hugging Face checkpoint folder nor a GGUF file")
    return convert_gguf(source, out, dtype, quantization)
