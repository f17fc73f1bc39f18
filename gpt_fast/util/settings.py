"""Process-wide torch settings. Only the command-line entry points call :func:`apply_torch_settings`."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CGROUP = Path("/sys/fs/cgroup")


def apply_torch_settings(
    device: torch.device | None = None, *, compiled: bool = True, threads: int | None = None
) -> None:
    """On the CPU, torch's thread count (:func:`cpu_threads`, ``threads`` when given). When ``compiled``, inductor's
    settings for generation: coordinate-descent tuning of the generated kernels (decode is made of matrix-vector
    products and reductions whose block sizes it tunes), readable kernel names in traces, and the on-disk FX graph
    cache so a second process starts warm, and the lighter per-step checks of :func:`apply_step_settings`. An eager
    run leaves inductor unimported (it takes seconds to import)."""
    if device is not None and device.type == "cpu":
        torch.set_num_threads(cpu_threads(threads)[0])
    if not compiled:
        return
    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = True
    inductor_config.triton.unique_kernel_names = True
    inductor_config.fx_graph_cache = True
    apply_step_settings()
    _use_workers_ptxas()
    _keep_tuned_configs_on_load()


def apply_step_settings() -> None:
    """Less host work per call of a compiled step, which is most of what a small model's CPU decode step costs
    beside its products: profiled, one int8 token of the default model took 0.92 ms in Dynamo's guards and 2.29 ms
    in inductor's Python wrapper and small kernels, against 0.42 and 2.06 ms with these settings
    (docs/bench/2026-11-30d_cpu_step_overhead.txt; docs/cpu.md, "Where a token's time goes").

    - Dynamo checks a module's guards only when its ``__dict__`` changed since the last call
      (``use_recursive_dict_tags_for_guards``). Replacing a module, a parameter, a buffer (new caches) or a kernel
      attribute changes the dict and is checked in full; a tensor's shape or dtype changed in place would not be,
      and nothing in gpt-fast does that.
    - Inductor's wrapper no longer asserts every input's size, stride and alignment on each call: Dynamo's guards
      hold the same facts for the step's inputs."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    dynamo_config.use_recursive_dict_tags_for_guards = True
    inductor_config.size_asserts = False
    inductor_config.alignment_asserts = False


def cpu_threads(requested: int | None = None) -> tuple[int, str]:
    """Torch's threads on the CPU and why: ``requested`` when given, ``OMP_NUM_THREADS`` when set to a positive
    integer, else the cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota. More threads
    than cores only wait on each other: on a loaded 2-core machine 2 threads decoded several times slower than 1."""
    if requested is not None:
        return requested, "as asked"
    setting = os.environ.get("OMP_NUM_THREADS", "").strip()
    if setting.isdigit() and int(setting) > 0:
        return int(setting), f"OMP_NUM_THREADS={int(setting)}"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None and quota < cores:
        return max(1, math.floor(quota)), f"the cgroup's CPU quota of {quota:g} cores"
    return cores, f"the {cores} cores available"


def cgroup_cpu_quota() -> float | None:
    """The cores this process's cgroup may use (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us / cpu.cfs_period_us``
    in v1, under :data:`CGROUP`, where a container sees its own cgroup); None without a quota."""
    root = CGROUP
    try:
        if (root / "cpu.max").is_file():
            quota, period = (root / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = root / "cpu"
        if (v1 / "cpu.cfs_quota_us").is_file():
            quota = int((v1 / "cpu.cfs_quota_us").read_text())
            return None if quota <= 0 else quota / int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):  # unreadable or not numbers: no quota known
        return None
    return None


def cpu_threads_note(requested: int | None = None) -> str:
    """Torch's thread count for the first line of a run: ``1 thread (OMP_NUM_THREADS=1)``."""
    count = torch.get_num_threads()
    threads, why = cpu_threads(requested)
    return f"{count} thread{'s' if count != 1 else ''}" + (f" ({why})" if count == threads else "")


def _use_workers_ptxas() -> None:
    """Point Triton at the ptxas inductor's compile workers use (the one inside torch's wheel, where there is one).

    The workers set it for themselves, this process does not: coordinate-descent tuning, which compiles here, would
    build its winning kernels with Triton's own ptxas, whose version is part of Triton's cache key — so the next
    process, which loads kernels the workers' way, would miss the cache and compile every tuned kernel again
    (measured on an H200 with torch 2.11: 24 kernels, +2.4 s, on the first warm start of the SmolLM2 shape)."""
    from torch._inductor.runtime import compile_tasks

    pin = getattr(compile_tasks, "_set_triton_ptxas_path", None)
    if pin is not None:
        pin()


def _keep_tuned_configs_on_load() -> None:
    """torch 2.11 only: make a kernel loaded from a cache (an ``--aot_precompile`` package, or inductor's FX graph
    cache) run the configuration coordinate-descent tuning found for it in an earlier process instead of tuning it
    again at its first call, which in 2.11 happens to 1-5 of the Llama-2-7B step's 24 kernels per warm start
    (1.5-11.6 s; docs/bench/HISTORY.md, 2026-11-23d). Two causes, both upstream bugs (pytorch/pytorch#172819, #181292):

    - ``CachingAutotuner.recheck_autotune_cache`` drops the cache entry's "found by coordinate descent" mark
      when the configuration it names is one the kernel compiled already, or its only one: replaced by
      :func:`recheck_autotune_cache`;
    - ``dynamic_scale_rblock`` adds halved-reduction-block configurations to a reduction kernel after its cache
      lookup, so that a hit is benchmarked and tuned again, and the kernel's list of configurations (which the
      cache entry is keyed by) differs between the process that saves an entry and the one that reads it: turned
      off. Coordinate-descent tuning, which also halves and doubles the reduction block, is unchanged.

    With both, four warm starts of the 7B package re-tuned no kernel; with the first alone, 1-3 per start."""
    if not torch.__version__.startswith("2.11."):
        return
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime import triton_heuristics

    triton_heuristics.CachingAutotuner.recheck_autotune_cache = recheck_autotune_cache
    inductor_config.dynamic_scale_rblock = False


def recheck_autotune_cache(self: Any, reload_kernel_from_src: Callable[[], Any]) -> None:
    """A cached kernel's check of the autotune cache: on a hit, keep only the compiled configuration the entry
    names (compiling it if it is not among them) and carry the entry's ``found_by_coordesc`` over to it, so that
    the kernel's first call does not tune it again. ``self`` is inductor's ``CachingAutotuner`` of a kernel that
    is launched statically."""
    from torch._inductor.runtime import triton_heuristics

    configs = [result.config for result in self.compile_results]
    cached, _, info = triton_heuristics.check_autotune_cache(configs, self.filename, self.inductor_meta)
    self.autotune_cache_info = info
    if len(cached) != 1:
        return
    best = cached[0]
    tuned = getattr(best, "found_by_coordesc", False)
    hashable = triton_heuristics.triton_config_to_hashable
    match = next((r for r in self.compile_results if hashable(r.config) == hashable(best)), None)
    if match is None:
        if not tuned:
            return
        if self.fn.fn is None:
            self.fn = reload_kernel_from_src().fn
        match = self._precompile_config(best)
    match.config.found_by_coordesc = tuned
    self.compile_results = [match]
