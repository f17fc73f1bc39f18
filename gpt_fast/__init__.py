"""gpt-fast: fast LLM text generation in native PyTorch.

The Python API (see README, "Python API")::

    from gpt_fast import Engine, SamplingConfig
    engine = Engine.load()  # the default model; or Engine.load("checkpoints/ORG/NAME", compile=..., device=...)
    print(engine.generate("The capital of France is", max_new_tokens=20)[0].text)

The names below are imported on first use, so that ``import gpt_fast`` (and ``gpt-fast --help``) stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "Completion",
    "Engine",
    "EngineOptions",
    "OutputConstraint",
    "SamplingConfig",
    "SpeculativeOptions",
    "__version__",
]
_HOMES = {
    "Completion": "engine.engine",
    "Engine": "engine.engine",
    "EngineOptions": "engine.options",
    "OutputConstraint": "generation.options",
    "SamplingConfig": "generation.options",
    "SpeculativeOptions": "generation.options",
}

if TYPE_CHECKING:
    from gpt_fast.engine.engine import Completion, Engine, EngineOptions
    from gpt_fast.generation.options import OutputConstraint, SpeculativeOptions
    from gpt_fast.generation.sampling import SamplingConfig


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'gpt_fast' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gpt_fast.{_HOMES[name]}"), name)
