"""Small file helpers every command shares: strict JSON reading, output checks, atomic writes, one-line errors."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STDOUT = "-"  # an output path meaning standard output


def first_line(err: BaseException) -> str:
    """The first non-empty line of an error's message (some libraries write ``\\n`` escapes), or its type's name."""
    for line in re.split(r"\\n|\n", str(err)):
        line = line.strip().removeprefix("b'").removeprefix('b"').strip()
        if line:
            return line
    return type(err).__name__


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object; FileNotFoundError or a one-line ValueError naming the file otherwise."""
    if not path.exists():
        raise FileNotFoundError(f"missing {path}")
    regular_file(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON: nested too deeply") from None
    except ValueError as err:  # also UnicodeDecodeError, and integers of more digits than Python converts
        raise ValueError(f"{path} is not valid JSON: {first_line(err)}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data


def regular_file(path: Path, what: str = "") -> Path:
    """``path`` if it is a regular file (or a link to one); FileNotFoundError, or a one-line ValueError for a
    folder, pipe, socket or device, decided from ``stat`` without opening it (opening a pipe would block)."""
    label = f"{what} {path}" if what else str(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"missing {label}") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file (a pipe, socket or device)"
        raise ValueError(f"{label} is {kind}")
    return path


def inside_folder(folder: Path, name: str, field: str) -> Path:
    """``folder / name`` for a file name read from a file (``field`` says where): relative, without ``..``, and
    still inside ``folder`` once symbolic links are resolved; a one-line ValueError otherwise."""
    relative = Path(name)
    if not name or relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"{field}: {name!r} is not a path inside {folder}")
    path = folder / relative
    if not path.resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"{field}: {name!r} leads outside {folder} (through a symbolic link)")
    return path


def check_output_file(path: Path, flag: str) -> Path:
    """Check, before any work, that ``path`` can be written: standard output (``-``), an existing device or pipe
    (written through), or a file in an existing, writable folder."""
    if str(path) == STDOUT:
        return path
    if path.is_dir():
        raise IsADirectoryError(f"{flag}: {path} is a folder")
    if path.exists() and not path.is_file():
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{flag}: {path} is not writable")
        return path
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"{flag}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"{flag}: folder {folder} is not writable")
    return path


def check_output_dir(out_dir: Path, flag: str = "output folder") -> Path:
    """Check before any work that ``out_dir`` exists or can be created, and is writable."""
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {out_dir}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"{flag} {out_dir} is not writable")
    return out_dir


def _default_file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A new temporary file beside ``path`` (unpredictable name, created exclusively, so a planted link is never
    followed) for the block to write; renamed onto ``path`` when the block succeeds, removed otherwise. Readers
    never see a partial file, and an interrupted write leaves what was there."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        os.fchmod(fd, _default_file_mode())
        os.close(fd)
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically; ``-`` is standard output, and an existing device or pipe (such as
    ``/dev/stdout``) is written through rather than replaced."""
    if str(path) == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    if path.exists() and not stat.S_ISREG(path.stat().st_mode):
        with path.open("w", encoding="utf-8") as out:
            out.write(text)
        return
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
