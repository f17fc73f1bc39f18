"""Writing a checkpoint folder atomically.

Everything is first written into a hidden staging folder inside the output folder, then moved into place with
renames, so an error or Ctrl-C leaves no partial ``model.pth`` and an existing checkpoint untouched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from gpt_fast.config import CONFIG_FILE, CheckpointConfig


@contextmanager
def staging_dir(out_dir: Path) -> Iterator[Path]:
    """A temporary folder inside ``out_dir`` that is always removed; ``out_dir`` is removed too if it was created
    here and nothing was moved into it."""
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".gpt-fast-staging-", dir=out_dir))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()


def write_checkpoint(
    out_dir: Path, state: Mapping[str, torch.Tensor], prepare: Callable[[Path], CheckpointConfig]
) -> CheckpointConfig:
    """Write the tokenizer files (``prepare(stage)`` writes them into the staging folder and returns the
    checkpoint's config), ``config.json`` and ``state`` as ``config.weights``, then move them all into ``out_dir``."""
    with staging_dir(out_dir) as stage:
        config = prepare(stage)
        torch.save(dict(state), stage / config.weights)
        (stage / CONFIG_FILE).write_text(config.to_json(), encoding="utf-8")
        # The weights go last: a checkpoint is only complete once its model.pth is in place.
        for name in sorted((p.name for p in stage.iterdir()), key=lambda n: n == config.weights):
            os.replace(stage / name, out_dir / name)
    return config
