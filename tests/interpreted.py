"""Run a script, or ``-c`` code, in Triton's interpreter: ``python tests/interpreted.py SCRIPT [ARG ...]`` or
``python tests/interpreted.py -c CODE`` (with ``TRITON_INTERPRET=1`` set, as :func:`tests.interpreter.interpret_all`
sets it).

Why not plain ``python``: Triton 3.6's interpreter patches ``triton.language`` on every call of a ``@triton.jit``
helper from inside a kernel, each program of each launch, although the launch has patched the same modules already;
in our kernels, which call helpers in their loops, that was two fifths of the interpreter's time. Here a launch
patches each module once, and a helper's call that would patch only modules the launch has patched skips it: the
patches are the same objects' same attributes, so what runs is what the interpreter would run.
"""

from __future__ import annotations

import inspect
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class _Unpatched:
    """The scope of a patch that was not made: nothing to restore."""

    def restore(self) -> None:
        pass


def _language_modules(fn: Callable[..., Any]) -> frozenset[int]:
    """The ids of the ``triton.language`` modules ``fn`` sees, as the interpreter finds them to patch."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def patch_once_per_launch() -> None:
    """Make each launch patch ``triton.language`` once (above). A Triton without these internals is left as is."""
    from triton.runtime import interpreter

    if not (hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "GridExecutor")):
        return
    patch, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched: set[int] | None = None  # the modules the launch running now has patched (None: no launch)

    def patch_lang(fn: Callable[..., Any]) -> Any:
        modules = _language_modules(fn)
        if patched is not None and modules <= patched:
            return _Unpatched()
        scope = patch(fn)
        if patched is not None:
            patched.update(modules)
        return scope

    def run_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal patched
        patched = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched = None

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = run_launch


def main(argv: list[str]) -> None:
    """Run ``argv`` (``-c CODE [ARG ...]`` or ``SCRIPT [ARG ...]``) as ``python`` would, the interpreter patched."""
    patch_once_per_launch()
    if argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv, sys.path[0] = argv, str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
