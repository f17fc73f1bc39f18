"""Small file helpers every command shares: strict JSON reading, output checks, atomic writes, one-line errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

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
    if not os.path.lexists(path):
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
    except OSError as err:  # a loop of symbolic links, a component that is not a folder
        raise ValueError(f"{label} cannot be opened: {err.strerror or err}") from None
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
    try:
        resolved = path.resolve()
    except (RuntimeError, OSError):  # Python raises RuntimeError for a loop of symbolic links
        raise ValueError(f"{field}: {name!r} is a loop of symbolic links") from None
    if not resolved.is_relative_to(folder.resolve()):
        raise ValueError(f"{field}: {name!r} leads outside {folder} (through a symbolic link)")
    return path


def check_output_file(path: Path, flag: str) -> Path:
    """Check, before any work, that ``path`` can be written: standard output or error (``-``, ``/dev/stdout``),
    an existing device or pipe (written through), or a file in an existing, writable folder."""
    if standard_stream(path) is not None:
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
    _probe_folder(folder, path.name, flag)
    return path


def _probe_folder(folder: Path, name: str, flag: str) -> None:
    """Create and remove, in ``folder``, the kind of private folder :func:`atomic_path` writes through: permission
    bits do not tell everything (``/proc`` and read-only file systems refuse what ``os.access`` allows root)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=folder))
    except OSError as err:
        raise PermissionError(f"{flag}: cannot write in folder {folder} ({err.strerror or err})") from None


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


def default_mode(bits: int) -> int:
    """The permissions a new file (``0o666``) or folder (``0o777``) gets under the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    return bits & ~mask


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path for the block to write, renamed onto ``path`` when the block succeeds; removed otherwise.
    Readers never see a partial file, and an interrupted write leaves what was there.

    The temporary path lies in a new private folder beside ``path`` (unpredictable name, created exclusively by
    ``mkdtemp``, mode 0700), so nobody can plant a link at it, even for code that opens it by name (``torch.save``,
    the profiler's trace export). A link at ``path`` itself is replaced by the file, never followed."""
    folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp = folder / path.name
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def standard_stream(path: Path) -> TextIO | None:
    """Standard output or error when ``path`` is ``-`` or names the file descriptor 1 or 2 is open on:
    ``/dev/stdout``, ``/proc/self/fd/2``, or the file the shell redirected standard output to. Such a path is
    written through the stream, after what was already printed, never truncated or replaced (``/dev/stdout`` is a
    link: replacing it would take it away from every process, and as root it can be)."""
    if str(path) == STDOUT:
        return sys.stdout
    try:
        target = path.stat()
    except (OSError, ValueError):
        return None
    for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
        try:
            if os.path.samestat(target, os.fstat(fd)):
                return stream
        except OSError:  # closed
            continue
    return None


def write_through(path: Path, text: str) -> bool:
    """Write ``text`` into ``path`` if it is an existing device or pipe (``/dev/null``, a named pipe), which cannot
    be replaced atomically; False, writing nothing, when it is not one. Opened without creating or truncating, and
    checked again once open, so a regular file swapped in meanwhile is never written this way."""
    try:
        if stat.S_ISREG(path.stat().st_mode):
            return False
    except FileNotFoundError:
        return False
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOCTTY", 0))  # a terminal never becomes ours to control
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    return True


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path``: standard output or error (``-``, ``/dev/stdout``) and devices or pipes are written
    through; anything else is replaced atomically (a link to a regular file is replaced by a file, its target left
    as it was: following it would let a link planted at a predictable output path redirect the write)."""
    stream = standard_stream(path)
    if stream is not None:
        stream.write(text)
        stream.flush()
        return
    if write_through(path, text):
        return
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def file_lock(path: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """Hold the exclusive lock named by the file ``path`` for the block; ``on_wait()`` is called once if another
    holder makes us wait. The file is created if needed (never through a link) and removed on release.

    With ``fcntl`` the lock is ``flock``'s: waiting, released by the system when a holder dies, and exclusive
    between threads too (each opens its own file description). Without it (Windows) the file's exclusive creation
    is the lock: a second holder is refused, and a file left by a killed holder must be deleted by hand."""
    if fcntl is None:
        fd = _create_lock_file(path)
    else:
        fd = _flock(path, on_wait)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _create_lock_file(path: Path) -> int:
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        raise FileExistsError(
            f"{path} exists: another gpt-fast process is writing there (delete it if none is running)"
        ) from None


def _flock(path: Path, on_wait: Callable[[], None]) -> int:
    """An open descriptor of ``path`` holding its flock. A holder removes the file before releasing it, so a waiter
    that then gets the lock of the removed file opens the path again."""
    waited = False
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"lock file {path} is not a regular file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waited:
                    on_wait()
                    waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            if _names(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _names(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except FileNotFoundError:
        return False


@contextmanager
def native_stderr_without(pattern: re.Pattern[bytes]) -> Iterator[None]:
    """Run the block with file descriptor 2, where native libraries write, going to a temporary file, then write
    to it again the lines that do not match ``pattern``: a library's log lines leave the user's output alone."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = b"".join(line for line in captured if not pattern.match(line))
            if kept:
                os.write(2, kept)


def trace_file(profile: str | os.PathLike, name: str = "trace", variant: str = "") -> Path:
    """The trace file ``--profile PATH`` names, after checking that it can be written: a folder (an existing one, or
    PATH ending in ``/``, then created) holds ``NAME.json``; any other PATH is the file itself, ``.json`` added unless
    present. ``variant`` tells apart the files of several runs (one per compile mode): ``PATH_VARIANT.json``."""
    text = os.fspath(profile)
    if text.endswith(("/", os.sep)):
        folder = check_output_dir(Path(text), "--profile")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise PermissionError(f"--profile: cannot create folder {folder} ({err.strerror or err})") from None
    if Path(text).is_dir():
        return check_output_file(Path(text) / f"{name}.json", "--profile")
    stem = text.removesuffix(".json")
    return check_output_file(Path(f"{stem}_{variant}.json" if variant else f"{stem}.json"), "--profile")
