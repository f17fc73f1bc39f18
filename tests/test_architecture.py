"""The import rules of docs/architecture.md, checked on the source: the model imports nothing above it, the engine
no command, the converter neither, and commands reach the model only through the engine."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpt_fast"
SERVER = {"serve.app", "serve.openai_api", "serve.sse", "serve.server"}
COMMANDS = {"cli", "runner", "interactive", "bench", "bench_decode", "bench_speculative", "bench_serve", "evaluate"}
COMMANDS |= {"bench_tp", "launch"}
COMMANDS |= SERVER
ENGINE_PRIVATE = {"model", "cache", "checkpoint", "tokenizer"}  # what commands reach only through the engine


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def imported(path: Path) -> set[str]:
    """The gpt_fast modules ``path`` imports (at any level, lazily too), without the package prefix."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gpt_fast."):
            names.add(node.module.removeprefix("gpt_fast."))
        elif isinstance(node, ast.Import):
            names |= {a.name.removeprefix("gpt_fast.") for a in node.names if a.name.startswith("gpt_fast.")}
    return names


MODULES = {module_name(p): imported(p) for p in PACKAGE.rglob("*.py")}


@pytest.mark.parametrize("module", ["model", "cache"])
def test_the_model_imports_only_its_config(module):
    assert MODULES[module] <= {"config", "cache"}


QUANT_LAYERS = [
    "quant.schemes",
    "quant.layout",
    "quant.linear",
    "quant.kernels",
    "quant.triton_gemv",
    "quant.triton_matmul",
    "quant.gptq",
    "quant.calibrate",
]


@pytest.mark.parametrize("module", QUANT_LAYERS)
def test_the_quantized_layers_import_only_the_model_and_each_other(module):
    assert MODULES[module] <= {"config", "model", "cache", "quant", "triton_pdl", "triton_row", *QUANT_LAYERS}


@pytest.mark.parametrize("module", ["triton_pdl", "triton_row"])
def test_the_triton_helpers_shared_by_quant_and_kernels_import_nothing_of_ours(module):
    assert MODULES[module] == set()


def test_tensor_parallelism_imports_only_the_model_its_quantized_layers_and_its_fused_products():
    assert MODULES["parallel"] <= {"config", "model", "quant.layout", "quant.linear", "kernels.linear"}


def test_the_model_does_not_know_torch_distributed():
    for module in ("model", "cache"):
        assert "torch.distributed" not in (PACKAGE / f"{module}.py").read_text()


KERNELS = sorted(m for m in MODULES if m.startswith("kernels."))


@pytest.mark.parametrize("module", KERNELS)
def test_the_kernels_import_only_the_model_and_each_other(module):
    quantized = {"quant.kernels", "quant.linear"}  # whether Triton is usable; whether a quantized layer fuses a row
    assert MODULES[module] <= {"config", "model", "cache", *quantized, "kernels", "triton_pdl", "triton_row", *KERNELS}


@pytest.mark.parametrize("module", ["engine", "batching", "slots"])
def test_the_engine_imports_no_command(module):
    assert not MODULES[module] & (COMMANDS | {"trace_summary", "download"})


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("convert.")))
def test_the_converter_imports_no_engine_and_no_command(module):
    assert not MODULES[module] & (COMMANDS | {"engine"})


@pytest.mark.parametrize("module", sorted(COMMANDS))
def test_commands_reach_the_model_through_the_engine(module):
    assert not MODULES[module] & ENGINE_PRIVATE


def test_every_module_is_in_the_architecture_map():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    leaves = {m.rsplit(".", 1)[-1] for m in MODULES} - {"__init__", "__main__"}
    missing = [leaf for leaf in leaves if f"{leaf}.py" not in text]
    assert not missing
