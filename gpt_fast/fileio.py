"""Small file helpers shared by the commands: strict JSON reading, output checks, atomic writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object; FileNotFoundError or a one-line ValueError naming the file otherwise."""
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def check_output_file(path: Path, flag: str) -> Path:
    """Check, before any work, that the folder ``path`` will be written into exists and is writable."""
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"{flag}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"{flag}: folder {folder} is not writable")
    return path


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a hidden temporary name beside ``path``, then rename: readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
