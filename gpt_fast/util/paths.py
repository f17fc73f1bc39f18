"""Where gpt-fast keeps checkpoints, named in one place."""

from __future__ import annotations

import os
from pathlib import Path

CHECKPOINTS_DIR = Path("checkpoints")  # the blog's layout: checkpoints/ORG/NAME in the working directory
HF_SUBDIR = "hf"  # `gpt-fast download ORG/NAME` puts the hub's files in checkpoints/ORG/NAME/hf
CACHE_ENV = "GPT_FAST_CACHE"  # overrides the per-user cache folder


def user_cache_dir() -> Path:
    """The per-user cache (the default model lives there): ``$GPT_FAST_CACHE``, else ``$XDG_CACHE_HOME/gpt-fast``,
    else ``~/.cache/gpt-fast``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpt-fast"
