"""Recording a Chrome/Perfetto trace of generation with the PyTorch profiler.

The generator marks the prefill and each decode step with the names below, so that a trace can be read
phase by phase (``gpt-fast trace-summary``); speculative decoding marks each round's draft phase and its verify
step instead of decode steps.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gpt_fast.util.fileio import atomic_path, check_output_dir, check_output_file, native_stderr_without

PREFILL_MARK = "gpt_fast::prefill"
DECODE_MARK = "gpt_fast::decode"
DRAFT_MARK = "gpt_fast::draft"
VERIFY_MARK = "gpt_fast::verify"
# The profiler library's own log lines on stderr: "USDT:2026-11-28 23:19:15 25308:25308 File.cpp:52] profiler_start"
KINETO_LOG = re.compile(rb"[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] ")


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


@contextlib.contextmanager
def record_trace(path: Path, device: torch.device) -> Iterator[None]:
    """Profile the enclosed code on the CPU and, on a GPU, its kernels and runtime calls (CUDA-graph launches
    appear as ``cudaGraphLaunch`` / ``hipGraphLaunch``); write the trace to ``path`` atomically."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, acc_events=True)  # one cycle; also quiets a warning about cycles
    with native_stderr_without(KINETO_LOG):  # its "profiler_start" line would land in the streamed text
        prof.start()
    try:
        yield
    finally:
        with native_stderr_without(KINETO_LOG):
            prof.stop()
    with atomic_path(path) as tmp:
        prof.export_chrome_trace(str(tmp))
