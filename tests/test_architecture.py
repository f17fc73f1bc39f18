"""The import rules of docs/architecture.md, checked on the source: each package imports only the packages below
it, the model knows no kernel, quantization or parallelism, and commands reach the model only through the engine."""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpt_fast"

# Each package and the packages it may import, bottom to top (docs/architecture.md, "Layers").
LAYERS = {
    "util": set(),
    "kernels": set(),
    "model": {"util"},
    "text": {"util", "model"},
    "quant": {"util", "model", "kernels"},
    "accel": {"util", "model", "quant", "kernels"},
    "parallel": {"util", "model", "quant", "accel", "kernels"},
    "checkpoint": {"util", "model", "text", "quant", "parallel"},
    "convert": {"util", "model", "text", "quant", "kernels", "checkpoint"},
    "generation": {"util", "model", "text", "kernels"},
    "engine": {"util", "model", "text", "quant", "kernels", "accel", "parallel", "checkpoint", "convert", "generation"},
    "serve": {"util", "generation", "engine"},
    "jobs": {"util", "text", "generation", "engine"},
    "bench": {"util", "model", "quant", "kernels", "accel", "parallel", "convert", "generation", "engine", "jobs"},
    "cli": {"util", "model", "quant", "accel", "parallel", "convert", "generation", "engine", "serve", "jobs", "bench"},
}
ALIASES = {"__init__", "__main__", "bench_decode", "bench_serve", "bench_speculative", "bench_tp"}
ENGINE_PRIVATE = {"model.transformer", "model.cache", "checkpoint.load", "text.tokenizer"}  # reached only via engine
COMMANDS = ("serve", "jobs", "cli")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def program_entry(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``, the block that runs a module as a program (``python -m``), never on import."""
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("__name__ == '__main__'", '__name__ == "__main__"')


def walk(node: ast.AST, entry: bool, inside: bool = False) -> Iterator[ast.AST]:
    """The nodes under ``node`` inside program entry blocks (``entry``) or outside them."""
    for child in ast.iter_child_nodes(node):
        within = inside or program_entry(child)
        if within == entry:
            yield child
        yield from walk(child, entry, within)


def imported(path: Path, entry: bool = False) -> set[str]:
    """The gpt_fast modules ``path`` imports (at any level, lazily too), without the package prefix; a name taken
    from a module counts as ``module.name`` too, so that ``from gpt_fast.model import transformer`` is seen. Imports
    in a program entry block (``if __name__ == "__main__":``) count apart, with ``entry``: that block runs the
    command that wraps the module (``python -m gpt_fast.bench.decode`` is ``gpt-fast bench decode``)."""
    names = set()
    for node in walk(ast.parse(path.read_text()), entry):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gpt_fast."):
            names.add(node.module.removeprefix("gpt_fast."))
            names |= {f"{node.module.removeprefix('gpt_fast.')}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name.removeprefix("gpt_fast.") for a in node.names if a.name.startswith("gpt_fast.")}
    return names


MODULES = {module_name(p): imported(p) for p in PACKAGE.rglob("*.py")}
PROGRAM_ENTRIES = {module_name(p): imported(p, entry=True) for p in PACKAGE.rglob("*.py")}


def package(module: str) -> str:
    return module.split(".", 1)[0]


def test_every_module_lives_in_a_package_of_the_map():
    loose = [m for m in MODULES if "." not in m and m not in ALIASES]
    assert not loose
    assert {package(m) for m in MODULES if "." in m} == set(LAYERS)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_package_imports_only_the_packages_below_it(name):
    reached = {package(i) for m, imports in MODULES.items() if package(m) == name for i in imports}
    assert reached - {name} <= LAYERS[name]


def test_a_program_entry_reaches_only_the_command_line():
    for module, imports in PROGRAM_ENTRIES.items():
        assert {package(i) for i in imports} <= {"cli"}, module


def test_the_layers_have_no_cycle():
    order = list(LAYERS)
    for index, name in enumerate(order):
        assert LAYERS[name] <= set(order[:index])


@pytest.mark.parametrize("module", ["model.transformer", "model.cache"])
def test_the_model_imports_only_its_config(module):
    assert all(i.startswith(("model.config", "model.cache")) for i in MODULES[module])


def test_the_model_does_not_know_torch_distributed():
    for module in ("transformer", "cache"):
        assert "torch.distributed" not in (PACKAGE / "model" / f"{module}.py").read_text()


@pytest.mark.parametrize("name", COMMANDS)
def test_commands_reach_the_model_through_the_engine(name):
    for module, imports in MODULES.items():
        if package(module) == name:
            assert not {i for i in imports if any(i == p or i.startswith(p + ".") for p in ENGINE_PRIVATE)}, module


# What commands may take from generation: values and types (sampling settings, output constraints and their errors,
# figures, profile marks, results); never the loop, a step, a drafter or a matcher, which only the engine drives.
GENERATION_FOR_COMMANDS = {
    "generation.options",
    "generation.options.SamplingConfig",
    "generation.options.SpeculativeOptions",
    "generation.options.LogitAdjustments",
    "generation.options.OutputConstraint",
    "generation.options.ToolSpec",
    "generation.constraint",
    "generation.constraint.GrammarError",
    "generation.options.MAX_BIAS",
    "generation.options.MAX_BIASED",
    "generation.options.MAX_PENALTY",
    "generation.sampling",
    "generation.sampling.SamplingConfig",
    "generation.metrics",
    "generation.profiling",
    "generation.loop",
    "generation.loop.GenerationResult",
    "generation.speculative",
    "generation.speculative.SpeculativeResult",
    "generation.speculative.SpeculativeOptions",
}


@pytest.mark.parametrize("name", COMMANDS)
def test_commands_reach_the_decode_loop_through_the_engine(name):
    for module, imports in MODULES.items():
        if package(module) != name:
            continue
        taken = {i for i in imports if package(i) == "generation" and i.count(".") >= 1}
        allowed = {i for i in taken if i in GENERATION_FOR_COMMANDS or i.rsplit(".", 1)[0] in METRICS_AND_MARKS}
        assert taken == allowed, (module, taken - allowed)


METRICS_AND_MARKS = {"generation.metrics", "generation.profiling"}


def test_every_module_is_in_the_architecture_map():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [m for m in MODULES if "." in m and not m.endswith("__init__") and f"{m.split('.')[-1]}.py" not in text]
    assert not missing
