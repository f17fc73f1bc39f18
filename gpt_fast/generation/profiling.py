"""Recording a Chrome/Perfetto trace of generation with the PyTorch profiler.

The generator marks the prefill and each decode step with the names below, so that a trace can be read
phase by phase (``gpt-fast trace-summary``); speculative decoding marks each round's draft phase and its verify
step instead of decode steps.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gpt_fast.util.fileio import atomic_path, native_stderr_without

PREFILL_MARK = "gpt_fast::prefill"
DECODE_MARK = "gpt_fast::decode"
DRAFT_MARK = "gpt_fast::draft"
VERIFY_MARK = "gpt_fast::verify"
# The profiler library's own log lines on stderr: "USDT:2026-11-28 23:19:15 25308:25308 File.cpp:52] profiler_start"
KINETO_LOG = re.compile(rb"[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] ")


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
