"""Writing a checkpoint folder as a whole: never partly, never a mix of two conversions, never into a folder that
is not a gpt-fast checkpoint.

The complete checkpoint is staged in a hidden sibling of the output folder NAME (same parent, so renames are
atomic), loaded back with the loader's own checks, then swapped in:

1. ``.NAME.gpt-fast-staging-XXXXXXXX`` (unpredictable, created exclusively and private by ``mkdtemp``) receives
   the tokenizer, ``config.json`` and the weights, and must pass :func:`gpt_fast.checkpoint.load.check_checkpoint`;
   it is then renamed ``.NAME.gpt-fast-new-XXXXXXXX``.
2. The entries of an existing NAME that are not its checkpoint's files nor the new one's (``hf/``, where the blog's
   layout keeps the downloaded source: ``convert checkpoints/ORG/NAME/hf --output_dir checkpoints/ORG/NAME``; a
   user's notes) are renamed into the new folder, so they survive the swap.
3. The new folder and NAME trade places in one ``renameat2(RENAME_EXCHANGE)`` (Linux). Where that call is missing
   or refused, NAME is renamed ``.NAME.gpt-fast-old-XXXXXXXX`` and the new folder NAME: NAME is then absent for
   the moment between the two renames, but never partial.
4. What is left (the old checkpoint) is deleted.

At every instant NAME is the whole old or the whole new checkpoint. A lock beside it (``.NAME.gpt-fast-lock``)
serializes writers: a second conversion into NAME waits for the first (saying so once on stderr), then replaces its
result as a whole. Whoever takes the lock first finishes what an interrupted writer left (SIGKILL, power loss):
a staging folder is deleted; a ``new`` or ``old`` folder becomes NAME if NAME is missing (step 3 interrupted),
otherwise gives back the entries carried in step 2 and is deleted. Only folders with exactly these names are
touched. Ctrl-C and errors run the same clean-up at once.

An existing NAME is replaced only when it holds a gpt-fast checkpoint (its config.json has our ``"format"`` marker;
any version, so an old checkpoint can be converted again), is empty, or holds nothing but ``hf/``. A Hugging Face
folder or a user's own files are refused before any work.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from gpt_fast.checkpoint.load import check_checkpoint
from gpt_fast.model.config import CONFIG_FILE, FORMAT_NAME, WEIGHTS_FILE, CheckpointConfig
from gpt_fast.util.fileio import check_output_dir, default_mode, file_lock, read_json_object
from gpt_fast.util.paths import HF_SUBDIR

STAGING, NEW, OLD = "staging", "new", "old"  # the steps' folder kinds, in the order clean-up handles them
LEGACY_STAGING = re.compile(r"\.gpt-fast-staging-[a-z0-9_]{8}")  # inside NAME, left by versions before this one
RENAME_EXCHANGE = 2  # from <linux/fs.h>
AT_FDCWD = -100

_held = threading.local()  # the output folders whose lock this thread holds


def target_dir(out_dir: Path) -> Path:
    """The folder a conversion into ``out_dir`` replaces: absolute, through links (a link to a folder stays and
    names the new checkpoint). A link to nothing is refused: it would make the folder wherever it points."""
    for path in (Path(out_dir), *Path(out_dir).parents):
        if path.is_symlink() and not path.exists():
            raise FileNotFoundError(f"output folder {out_dir}: {path} is a link to nothing ({os.readlink(path)})")
    out = Path(out_dir).resolve()
    if out == out.parent:
        raise ValueError(f"output folder {out_dir} cannot be a file system's root")
    return out


def check_checkpoint_output(out_dir: Path) -> Path:
    """Check before any work that a checkpoint can be written to ``out_dir``: writable, and new, empty or a
    replaceable checkpoint folder (see :func:`check_replaceable`)."""
    check_output_dir(out_dir)
    check_replaceable(target_dir(out_dir))
    return out_dir


def check_replaceable(out: Path) -> None:
    """Refuse an existing ``out`` unless it holds a gpt-fast checkpoint, is empty, or holds nothing but ``hf/``."""
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise NotADirectoryError(f"output folder {out} is not a folder")
    entries = sorted(e for e in os.listdir(out) if not LEGACY_STAGING.fullmatch(e))
    if CONFIG_FILE in entries:
        if not is_gpt_fast_config(out / CONFIG_FILE):
            raise FileExistsError(
                f"refusing to write into {out}: its {CONFIG_FILE} is not a gpt-fast checkpoint's (a Hugging Face "
                "folder?); choose a new or empty output folder"
            )
        return
    foreign = [e for e in entries if not (e == HF_SUBDIR and (out / e).is_dir())]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise FileExistsError(
            f"refusing to write into {out}: it holds {shown} and no gpt-fast checkpoint; choose a new or empty "
            "output folder"
        )


def is_gpt_fast_config(path: Path) -> bool:
    try:
        return read_json_object(path).get("format") == FORMAT_NAME
    except ValueError:
        return False


def checkpoint_files(folder: Path) -> set[str]:
    """The entries of ``folder`` its checkpoint consists of: config.json and the weights and tokenizer files it
    names (their first path component); none without a config.json."""
    if not (folder / CONFIG_FILE).is_file():
        return set()
    config = read_json_object(folder / CONFIG_FILE)
    tokenizer = config.get("tokenizer")
    names = [
        CONFIG_FILE,
        config.get("weights", WEIGHTS_FILE),
        tokenizer.get("file") if isinstance(tokenizer, dict) else None,
    ]
    return {Path(n).parts[0] for n in names if isinstance(n, str) and Path(n).parts}


def leftover_prefix(out: Path, kind: str) -> str:
    return f".{out.name}.gpt-fast-{kind}-"


def leftovers(out: Path) -> list[tuple[str, Path]]:
    """``(kind, path)`` of the folders a writer of ``out`` leaves beside it until it is done; staging first."""
    pattern = re.compile(re.escape(f".{out.name}.gpt-fast-") + f"({STAGING}|{NEW}|{OLD})-[a-z0-9_]{{8}}")
    found = []
    for entry in os.listdir(out.parent):
        match = pattern.fullmatch(entry)
        if match and stat.S_ISDIR(os.lstat(out.parent / entry).st_mode):
            found.append((match.group(1), out.parent / entry))
    return sorted(found, key=lambda item: ((STAGING, NEW, OLD).index(item[0]), item[1]))


def clean_leftovers(out: Path) -> None:
    """Finish what an interrupted writer of ``out`` left (see the module's docstring). Needs ``out``'s lock."""
    for kind, path in leftovers(out):
        if kind != STAGING and not os.path.lexists(out):
            os.rename(path, out)
            continue
        if kind != STAGING:
            give_back(path, out)
        shutil.rmtree(path)
    if out.is_dir():
        for entry in os.listdir(out):
            if LEGACY_STAGING.fullmatch(entry) and stat.S_ISDIR(os.lstat(out / entry).st_mode):
                shutil.rmtree(out / entry)


def give_back(leftover: Path, out: Path) -> None:
    """Move the entries carried into ``leftover`` (those not part of its checkpoint) back into ``out``, unless
    ``out`` has an entry of that name."""
    for entry in sorted(set(os.listdir(leftover)) - checkpoint_files(leftover)):
        if not os.path.lexists(out / entry):
            os.rename(leftover / entry, out / entry)


def waiting(out: Path) -> None:
    print(f"Waiting for another gpt-fast process writing {out} ...", file=sys.stderr, flush=True)


@contextmanager
def output_lock(out_dir: Path) -> Iterator[Path]:
    """Hold the lock of the output folder ``out_dir`` (waiting for another holder), having cleaned what an
    interrupted writer left; yields :func:`target_dir`. Re-entrant within a thread."""
    out = target_dir(out_dir)
    held = _held.__dict__.setdefault("folders", set())
    if out in held:
        yield out
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.parent / f".{out.name}.gpt-fast-lock", lambda: waiting(out)):
        held.add(out)
        try:
            clean_leftovers(out)
            yield out
        finally:
            held.discard(out)


def write_checkpoint(
    out_dir: Path, state: Mapping[str, torch.Tensor], prepare: Callable[[Path], CheckpointConfig]
) -> CheckpointConfig:
    """Write the tokenizer files (``prepare(stage)`` writes them into the staging folder and returns the
    checkpoint's config), ``config.json`` and ``state`` as ``config.weights``; check that the result loads, then
    put it in place of ``out_dir`` as a whole."""
    with output_lock(out_dir) as out:
        check_replaceable(out)
        try:
            stage = Path(tempfile.mkdtemp(prefix=leftover_prefix(out, STAGING), dir=out.parent))
            config = prepare(stage)
            torch.save(dict(state), stage / config.weights)
            (stage / CONFIG_FILE).write_text(config.to_json(), encoding="utf-8")
            validate(stage, out)
            install(stage, out)
        except BaseException:
            with contextlib.suppress(OSError):  # what remains is cleaned by the next writer
                clean_leftovers(out)
            raise
        clean_leftovers(out)
    return config


def validate(stage: Path, out: Path) -> None:
    """What `generate` would reject is not written: the error names the file as it would have been in ``out``."""
    try:
        check_checkpoint(stage)
    except (ValueError, OSError) as err:
        message = str(err).replace(str(stage), str(out))
        raise ValueError(f"the converted checkpoint does not load, {out} is left as it was: {message}") from None


def install(stage: Path, out: Path) -> None:
    """Steps 2 and 3 of the module's docstring: carry the entries that are not part of a checkpoint over, then
    swap the staged folder in."""
    suffix = stage.name.removeprefix(leftover_prefix(out, STAGING))
    new = out.parent / f"{leftover_prefix(out, NEW)}{suffix}"
    os.chmod(stage, stat.S_IMODE(out.stat().st_mode) if out.exists() else default_mode(0o777))
    os.rename(stage, new)
    if os.path.lexists(out):
        keep = checkpoint_files(out) | set(os.listdir(new))
        for entry in sorted(set(os.listdir(out)) - keep):
            os.rename(out / entry, new / entry)
        if exchange(new, out):
            return
        os.rename(out, out.parent / f"{leftover_prefix(out, OLD)}{suffix}")
    os.rename(new, out)


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """glibc's ``renameat2`` (2.28 and later), or None."""
    if sys.platform != "linux":
        return None
    func = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if func is not None:
        func.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
        func.restype = ctypes.c_int
    return func


def exchange(a: Path, b: Path) -> bool:
    """Swap the entries ``a`` and ``b`` in one step; False where the C library or the file system cannot."""
    func = _renameat2()
    if func is None:
        return False
    if func(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))
