"""Recording a Chrome/Perfetto trace of generation with the PyTorch profiler.

The generator marks the prefill and each decode step with the names below, so that a trace can be read
phase by phase (``gpt-fast trace-summary``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gpt_fast.fileio import atomic_path, check_output_file

PREFILL_MARK = "gpt_fast::prefill"
DECODE_MARK = "gpt_fast::decode"


def trace_file(path_prefix: str | os.PathLike) -> Path:
    """``PATH.json`` for ``--profile PATH``, after checking that its folder exists and is writable."""
    return check_output_file(Path(f"{os.fspath(path_prefix)}.json"), "--profile")


@contextlib.contextmanager
def record_trace(path: Path, device: torch.device) -> Iterator[None]:
    """Profile the enclosed code on the CPU and, on a GPU, its kernels and runtime calls (CUDA-graph launches
    appear as ``cudaGraphLaunch`` / ``hipGraphLaunch``); write the trace to ``path`` atomically."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        yield
    with atomic_path(path) as tmp:
        prof.export_chrome_trace(str(tmp))
