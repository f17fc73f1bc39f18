"""Devices and dtypes: the user's choice resolved and checked, names for reports, synchronization and memory."""

from __future__ import annotations

import os
import resource
import sys

import torch

from gpt_fast.util.choices import DTYPE_CHOICES, DTYPE_NAMES, KV_DTYPE_NAMES
from gpt_fast.util.options import OptionError

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16), strict=True))
KV_DTYPES = {name: getattr(torch, name) for name in KV_DTYPE_NAMES}
FLOAT8_CAPABILITY = (8, 9)  # NVIDIA GPUs from Ada and Hopper on convert 8-bit floats in hardware; Triton needs them


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in KV_DTYPES.items()}[dtype]


def resolve_device(name: str | None) -> torch.device:
    """``None``: the GPU if there is one (CUDA or ROCm), else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise OptionError(f"device {name!r} is not a device (use cpu or cuda)", "device") from None
    if device.type not in ("cpu", "cuda"):
        raise OptionError(f"device {name!r} is not supported (use cpu or cuda)", "device")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError(f"device {name}: no CUDA or ROCm GPU is available to torch {torch.__version__}", "device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise OptionError(f"device {name}: only {torch.cuda.device_count()} GPU(s) present", "device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in DTYPES:
        raise OptionError(f"dtype {name!r} is not one of {', '.join(DTYPE_CHOICES)}", "dtype")
    return DTYPES[name]


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: ``auto``, the model's ``dtype``; else the one named (a float32 model's float16 cache
    reads half the bytes a step, docs/cpu.md, "A narrower KV cache"). ``name`` is one of
    :data:`gpt_fast.util.choices.KV_DTYPE_CHOICES`, as :class:`gpt_fast.engine.options.EngineOptions` checks it.
    A float8 cache (:data:`gpt_fast.util.choices.FLOAT8_KV`) halves a 16-bit model's (docs/serving.md, "A float8
    KV cache"); it is refused on an NVIDIA GPU older than :data:`FLOAT8_CAPABILITY`, whose compiled steps could not
    convert it, before anything is loaded."""
    if name == "auto":
        return dtype
    kv_dtype = KV_DTYPES[name]
    if kv_dtype.itemsize == 1 and device.type == "cuda" and torch.version.hip is None:
        capability = torch.cuda.get_device_capability(device)
        if capability < FLOAT8_CAPABILITY:
            found = ".".join(map(str, capability))
            raise OptionError(
                f"kv_cache_dtype {name} needs an NVIDIA GPU of compute capability 8.9 or more, not {found}",
                "kv_cache_dtype",
            )
    return kv_dtype


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def device_memory_bytes(device: torch.device) -> int:
    """The device's whole memory: a GPU's, or the host's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_free_bytes(device: torch.device) -> int:
    """Memory still to be had: a GPU's free memory and what torch's caching allocator holds unused, or the host's
    available physical memory for the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cudagraph_step_begin() -> None:
    """``torch.compiler.cudagraph_mark_step_begin()`` (a new step: the outputs of the last CUDA-graph replay may be
    overwritten), where a CUDA graph tree can exist: torch's function imports inductor, seconds of an eager run that
    compiles nothing. Every compiled step is made with ``torch.compile``, which loads inductor first."""
    if "torch._inductor" in sys.modules:
        torch.compiler.cudagraph_mark_step_begin()


def device_synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_used() -> tuple[float, str]:
    """Peak memory in GB: the CUDA caching allocator's reservation on a GPU, else the process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_reserved() / 1e9, "GPU, peak reserved"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, "host, peak RSS"
