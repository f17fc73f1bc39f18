"""precompile: the package key follows everything a package depends on; a package saved by one `gpt-fast generate`
is loaded by the next process and decodes the eager model's greedy tokens; a damaged package is compiled again and
replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt_fast.accel.linear import DecodeLinear, swap_linears
from gpt_fast.accel.top_k import triton_top_k
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.engine.engine import Engine
from gpt_fast.generation.decode import compile_options, decode_one_token
from gpt_fast.generation.precompile import LOADED, SAVED, SUFFIX, PrecompiledStep, package_key
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.model.config import ModelConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import Transformer

GREEDY = SamplingConfig(temperature=0)
OPTIONS = compile_options("default")


def tiny_model(
    dtype: torch.dtype = torch.float32, batch: int = 1, length: int = 64, embedding_scale: float = 1.0
) -> Transformer:
    config = ModelConfig(
        block_size=256, vocab_size=128, n_layer=2, n_head=4, dim=32, intermediate_size=64, n_local_heads=2,
        head_dim=8, rope_base=10000.0, norm_eps=1e-5, embedding_scale=embedding_scale,
    )  # fmt: skip
    model = Transformer(config).to(dtype)
    model.setup_caches(batch, length)
    return model


def key(model: Transformer, sampling: SamplingConfig = GREEDY, options: dict | None = None) -> str:
    return package_key(decode_one_token, model, sampling, OPTIONS if options is None else options)


def test_the_key_follows_what_a_package_depends_on(monkeypatch):
    model = tiny_model()
    base = key(model)
    assert key(tiny_model()) == base  # other weights, same everything else: the weights are inputs
    different = [
        key(model, SamplingConfig(temperature=0.8, top_k=200)),
        key(model, options=OPTIONS | {"coordinate_descent_tuning": not OPTIONS["coordinate_descent_tuning"]}),
        key(tiny_model(batch=2)),
        key(tiny_model(length=128)),
        key(tiny_model(torch.bfloat16)),
    ]
    with_kernel = tiny_model()
    with_kernel.layers[0].feed_forward.activation_kernel = lambda gate_up, activation: gate_up
    different.append(key(with_kernel))
    with_gemv = tiny_model()
    swap_linears(with_gemv.layers, DecodeLinear)  # our GEMV's layers, the same parameters
    different.append(key(with_gemv))
    with_sampler = tiny_model()
    with_sampler.top_k_sampler = triton_top_k
    different.append(key(with_sampler))
    monkeypatch.setattr("gpt_fast.generation.precompile.source_digest", lambda: "changed source")
    different.append(key(model))
    assert len({base, *different}) == len(different) + 1


def run_generate(checkpoint: Path, cache: Path, out: Path, device: str, *extra: str) -> dict:
    command = [sys.executable, "-m", "gpt_fast", "generate", "--checkpoint_path", str(checkpoint), "--device", device]
    command += ["--prompt", "Hello", "--max_new_tokens", "12", "--temperature", "0", "--num_samples", "1"]
    command += ["--metrics_json", str(out), *extra]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "device, mode",
    [
        pytest.param("cpu", "default", marks=pytest.mark.slow),
        pytest.param("cuda", "reduce-overhead", marks=pytest.mark.gpu),
    ],
)
def test_the_next_process_loads_the_package_and_decodes_as_eager(tmp_path, device, mode):
    """float32, so that the compiled step's greedy tokens are the eager model's (on the GPU too: CUDA graphs)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA or ROCm GPU")
    checkpoint = make_random_checkpoint(get_shape("tiny"), tmp_path / "ck", dtype=torch.float32, seed=1).parent
    engine = Engine.load(checkpoint, device=device, dtype="float32")
    eager = engine.generate_ids(engine.encode("Hello"), 12, GREEDY).tokens
    runs = []
    for index in range(3):
        out = tmp_path / f"{index}.json"
        extra = ("--dtype", "float32", "--compile", mode, "--aot_precompile")
        runs.append(run_generate(checkpoint, tmp_path / "cache", out, device, *extra))
        if index == 1:  # damage the package: the third run compiles it again
            (package,) = (tmp_path / "cache" / "gpt-fast-aot").glob(f"*{SUFFIX}")
            package.write_bytes(b"not a package")
    outcomes = [run["aot_package"] for run in runs]
    assert outcomes[0].startswith(SAVED) and outcomes[1].startswith(LOADED), outcomes
    assert outcomes[2].startswith(SAVED) and "did not load" in outcomes[2], outcomes
    assert [run["samples"][0]["generated_ids"] for run in runs] == [eager] * 3


def test_a_new_package_is_sought_only_when_the_model_caches_or_sampling_change(monkeypatch):
    """The digest is worked out on the first call and again only after new caches or other sampling; a key seen
    before reuses its function (no compile here: what would be obtained is recorded instead)."""
    obtained = []

    def obtain(self, key, model, sampling):
        obtained.append(key)
        return lambda model, sampling: None

    keyed = []

    def counted_key(*args):
        keyed.append(package_key(*args))
        return keyed[-1]

    monkeypatch.setattr(PrecompiledStep, "_obtain", obtain)
    monkeypatch.setattr("gpt_fast.generation.precompile.package_key", counted_key)
    step, model = PrecompiledStep(decode_one_token, OPTIONS), tiny_model()
    for _ in range(3):
        step(model, GREEDY)
    step(model, SamplingConfig(temperature=0.8, top_k=200))
    step(model, GREEDY)  # seen before: no new package
    model.setup_caches(2, 64)
    step(model, GREEDY)
    assert len(keyed) == 4 and len(obtained) == 3 and len(set(obtained)) == 3


def test_a_step_that_cannot_be_compiled_ahead_of_time_runs_without_a_package(monkeypatch, tmp_path):
    """torch's ahead-of-time compile is experimental: when it raises, the step runs as torch.compile makes it (here
    a stand-in that runs it eagerly) and says why there is no package; nothing is saved."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    class Compiled:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args):
            return self.fn(*args)

        def aot_compile(self, example):
            raise RuntimeError("restart the analysis")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: Compiled(fn))
    step, model = PrecompiledStep(decode_one_token, OPTIONS), tiny_model()
    step(model, GREEDY)
    assert step.outcome == "compiled without a package: the ahead-of-time compile failed (RuntimeError)"
    assert int(model.decode_state.input_pos) == 1
    assert not list(tmp_path.rglob(f"*{SUFFIX}"))


@pytest.mark.slow
@torch.no_grad()
def test_a_second_model_in_one_process_is_packaged_and_loaded_too(monkeypatch, tmp_path):
    """Dynamo made a float that differed from the first model's compile (here the embeddings' scale, as Gemma's)
    dynamic, which ``aot_compile`` could not trace (``TensorifyScalarRestartAnalysis``, torch 2.11 and 2.13): each
    model, whatever was compiled before it, is saved, then loaded by a new step."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    outcomes = []
    for scale in (1.0, 8.0):
        model = tiny_model(embedding_scale=scale)
        for _ in range(2):
            step = PrecompiledStep(decode_one_token, OPTIONS)
            step(model, GREEDY)
            outcomes.append(step.outcome.split(" to ")[0].split(" from ")[0])
    assert outcomes == [SAVED, LOADED, SAVED, LOADED]
