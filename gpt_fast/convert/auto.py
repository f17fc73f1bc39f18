"""`gpt-fast convert SOURCE`: a Hugging Face folder or a GGUF file, told apart by what is on disk."""

from __future__ import annotations

from pathlib import Path

from gpt_fast.convert.gguf_file import convert_gguf
from gpt_fast.convert.hf import convert_hf
from gpt_fast.fileio import regular_file
from gpt_fast.paths import CHECKPOINTS_DIR, HF_SUBDIR

GGUF_MAGIC = b"GGUF"


def default_output_dir(source: Path) -> Path:
    """checkpoints/ORG/NAME/hf -> checkpoints/ORG/NAME (the blog's layout); otherwise checkpoints/<name>."""
    if source.is_dir() and source.name == HF_SUBDIR:
        return source.parent
    return CHECKPOINTS_DIR / (source.stem if source.is_file() else source.name)


def is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def convert_source(source: Path, output_dir: Path | None = None, dtype: str | None = None) -> Path:
    """Convert ``source``; return the path of the written ``model.pth``."""
    if not source.exists():
        raise FileNotFoundError(f"source not found: {source}")
    out = output_dir if output_dir is not None else default_output_dir(source)
    if source.is_dir():
        return convert_hf(source, out, dtype)
    if not is_gguf(regular_file(source, "source")):
        raise ValueError(f"{source} is neither a Hugging Face checkpoint folder nor a GGUF file")
    return convert_gguf(source, out, dtype)
