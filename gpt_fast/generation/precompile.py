"""The decode step compiled ahead of time and kept on disk (``EngineOptions.aot_precompile``), so that a new process
runs it without Dynamo tracing the model again.

A warm start with ``torch.compile`` still traces the whole step in Python (3–4 s on an H200 for the SmolLM2 and
Llama-2-7B shapes, docs/bench/HISTORY.md, 2026-11-23c) before inductor's on-disk cache can serve the kernels. torch's
experimental ``aot_compile`` saves the traced and compiled step with its guards and Triton kernels;
``torch.compiler.load_compiled_function`` brings it back with no tracing at all.

Such a package is specialized to what it was compiled for, and unlike ``torch.compile`` it raises instead of
recompiling when its guards fail; torch also drops the guards on code. So each package is named by a digest of
everything it depends on (:func:`package_key`): torch and Python versions, the device, gpt-fast's own source, the
compile options, the model's config and every tensor's name, shape and dtype (quantization, caches, batch), the
sampling settings and the attention and activation kernels. Anything else loads as a new package or compiles one. A
package that cannot be loaded (another torch's, a damaged file) is compiled again and replaced, and a step that torch
fails to compile ahead of time runs as ``torch.compile`` makes it, without a package. The ahead-of-time trace keeps
every value static: Dynamo would otherwise make a float that differed from an earlier compile in the process
dynamic (a second model's embedding scale), which ``aot_compile`` cannot trace (``TensorifyScalarRestartAnalysis``,
torch 2.11 and 2.13). Packages live in inductor's cache folder, whose kernels they use, under ``gpt-fast-aot``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.model.transformer import Transformer
from gpt_fast.util.fileio import atomic_path

SUFFIX = ".aot"
# the attributes of the model's modules that swap their code for a kernel or launch theirs with PDL
KERNELS = (
    "decode_kernel",
    "rows_kernel",
    "activation_kernel",
    "gated_kernel",
    "row_kernels",
    "head_kernel",
    "layers_kernel",
    "top_k_sampler",
    "pdl",
)
LOADED, SAVED = "loaded", "compiled and saved"


def package_folder() -> Path:
    """Where packages are kept: inside inductor's cache folder (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "gpt-fast-aot"


@functools.cache
def source_digest() -> str:
    """A digest of gpt-fast's Python source (read once per process): torch keeps no guard on code, so a changed
    model must not load an old package."""
    digest = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def package_key(
    step: Callable[..., None], model: Transformer, sampling: SamplingConfig, options: dict[str, Any]
) -> str:
    """The digest that names the package of ``step`` compiled with ``options`` for ``model`` and ``sampling``."""
    device = next(model.parameters()).device
    # the caches (a layout and dtype of their own: strides, dtype) and the decode state are buffers
    tensors = [*model.named_parameters(), *model.named_buffers()]
    facts = {
        "step": f"{step.__module__}.{step.__qualname__}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "threads": torch.get_num_threads(),
        "source": source_digest(),
        "options": sorted((name, repr(value)) for name, value in options.items()),
        "config": dataclasses.asdict(model.config),
        "tensors": [(name, list(t.shape), list(t.stride()), str(t.dtype)) for name, t in tensors],
        "sampling": dataclasses.asdict(sampling),
        "kernels": kernel_facts(model),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def kernel_facts(model: Transformer) -> list[str]:
    """The classes of ``model``'s modules (``nn.Linear`` or one of our GEMVs) and the kernels set on them, by name:
    a package calls the kernels that were chosen when it was compiled."""
    facts = set()
    for module in model.modules():
        facts.add(type(module).__qualname__)
        for name in KERNELS:
            value = getattr(module, name, None)
            if isinstance(value, bool):
                facts.add(f"{name}={value}")
            elif value is not None:
                facts.add(f"{name}={getattr(value, '__qualname__', type(value).__qualname__)}")
    return sorted(facts)


def _aot_enabled() -> contextlib.AbstractContextManager[None]:
    """torch 2.11 gives ``torch.compile``'s result its ``aot_compile`` only with this Dynamo setting; later
    versions always do."""
    config = torch._dynamo.config
    return config.patch(enable_aot_compile=True) if hasattr(config, "enable_aot_compile") else contextlib.nullcontext()


class PrecompiledStep:
    """``step(model, sampling)`` compiled with ``options``, from a package on disk when there is one for them
    (:func:`package_key`), else compiled ahead of time and saved for the next process. ``outcome`` says how the
    last new package was obtained: :data:`LOADED`, :data:`SAVED`, or compiled without a package and why."""

    def __init__(self, step: Callable[..., None], options: dict[str, Any]) -> None:
        self.step, self.options = step, options
        self.outcome: str | None = None
        self._by_key: dict[str, Callable[..., None]] = {}
        # the decode loop calls this once per token: the digest is computed again only when the model, its decode
        # state (new caches) or the sampling differ from the last call's (held, so no other object takes their ids)
        self._last: tuple[Transformer, object, SamplingConfig, Callable[..., None]] | None = None

    def __call__(self, model: Transformer, sampling: SamplingConfig) -> None:
        last = self._last
        if last is None or last[0] is not model or last[1] is not model.decode_state or last[2] != sampling:
            key = package_key(self.step, model, sampling, self.options)
            if key not in self._by_key:
                self._by_key[key] = self._obtain(key, model, sampling)
            last = self._last = (model, model.decode_state, sampling, self._by_key[key])
        last[3](model, sampling)

    def _graph_setting(self) -> contextlib.AbstractContextManager[None]:
        """A loaded package takes CUDA graphs from inductor's global setting, not from its compile options."""
        return torch._inductor.config.patch({"triton.cudagraphs": bool(self.options.get("triton.cudagraphs"))})

    def _obtain(self, key: str, model: Transformer, sampling: SamplingConfig) -> Callable[..., None]:
        path = package_folder() / f"{key}{SUFFIX}"
        problem = ""
        if path.is_file():
            try:
                with path.open("rb") as file, self._graph_setting():
                    function = torch.compiler.load_compiled_function(file)
                self.outcome = f"{LOADED} from {path}"
                return function
            except Exception as err:  # torch's loader is experimental: any failure means compiling again
                problem = f" (the package there did not load: {type(err).__name__}: {str(err)[:200]})"
        with _aot_enabled():
            compiled = torch.compile(self.step, options=self.options, fullgraph=True)
        if not hasattr(compiled, "aot_compile"):
            self.outcome = f"compiled without a package: torch {torch.__version__} has no ahead-of-time compile"
            return compiled
        try:
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):  # see the module's docstring
                function = compiled.aot_compile(((model, sampling), {}))
        except Exception as err:  # torch's ahead-of-time compile is experimental too
            failed = f"the ahead-of-time compile failed ({type(err).__name__})"
            self.outcome = f"compiled without a package: {failed}{problem}"
            return compiled
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            function.save_compiled_function(str(tmp))
        self.outcome = f"{SAVED} to {path}{problem}"
        return function
