"""Tensor parallelism: the checks before loading, the slicing of a checkpoint, and two ranks over gloo (CPU,
torchrun) giving the unsplit model's greedy tokens and logits; an error in one rank ends them all; the CLI's
``--tp`` prints once. GPU: the Llama-2-7B shape split over the GPUs against one GPU (``-m gpu``, needs 2 GPUs)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpt_fast.accel.linear import use_linear_kernel
from gpt_fast.cli.main import main
from gpt_fast.convert.quantize import quantize_checkpoint
from gpt_fast.convert.random_init import make_random_checkpoint, random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.kernels.available import triton_usable
from gpt_fast.model.config import QuantConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import Transformer
from gpt_fast.parallel.tensor_parallel import (
    ParallelRow,
    Ranks,
    Shard,
    TensorParallel,
    check_tensor_parallel,
    device_of,
)
from gpt_fast.quant.layout import quantize_state
from gpt_fast.quant.schemes import dequantize_int4, dequantize_int8
from tests.interpreter import needs_triton, old_numpy

WORKER = Path(__file__).with_name("parallel_worker.py")
TIMEOUT_S = 120  # two ranks of a tiny model start and finish in about 15 s on two CPU cores
TINY = get_shape("tiny")  # 4 heads, 2 key/value heads, vocabulary 512
PROMPT = [256, 72, 101, 108, 108, 111]
WINDOW = [256, *range(40, 70)]


def torchrun(nproc: int, *args: str, timeout: float = TIMEOUT_S, **env: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` of ``args`` (with the environment variables ``env`` added), its output captured;
    killed (failing the test) past ``timeout``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    env = os.environ | env | {"PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize(
    "config, tp, quant, message",
    [
        (TINY, 4, None, "tp 4 is more than the model's 2 key/value heads (model.n_local_heads)"),
        (dataclasses.replace(TINY, n_head=6, n_local_heads=3), 2, None, "model.n_local_heads (3) is not divisible"),
        (dataclasses.replace(TINY, n_local_heads=4, n_head=4), 3, None, "model.n_head (4) is not divisible by 3"),
        (dataclasses.replace(TINY, intermediate_size=161), 2, None, "model.intermediate_size (161) is not divisible"),
        (get_shape("mixtral-8x7b"), 2, None, "does not split mixture-of-experts models"),
        (TINY, 2, QuantConfig("int4", 64), "attention.wo's 32 input columns per rank are not whole int4 groups of 64"),
    ],
)
def test_models_that_do_not_split_are_refused(config, tp, quant, message):
    with pytest.raises(ValueError, match="^tp") as error:
        check_tensor_parallel(config, quant, tp)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_cli_refuses_before_starting_any_rank(tiny_checkpoint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--checkpoint_path", str(tiny_checkpoint), "--device", "cpu", "--tp", "4"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert err.strip().splitlines() == [
        "error: --tp 4 is more than the model's 2 key/value heads "
        "(model.n_local_heads): each rank holds whole key/value heads"
    ]


def test_tp_outside_torchrun_says_how_to_start_the_ranks(tiny_checkpoint):
    engine = Engine.open(tiny_checkpoint, EngineOptions(device="cpu", tp=2))
    with pytest.raises(ValueError, match="start them with `torchrun --nproc_per_node 2"):
        engine.load_weights()


def test_the_shards_of_each_layer_make_the_whole_layer():
    config = TINY
    state = random_weights(config, torch.float32, seed=0)
    shards = [Shard(rank, 2).slice_state(state, config) for rank in range(2)]
    q, kv = config.q_size, config.kv_size
    wqkv = state["layers.0.attention.wqkv.weight"]
    parts = [s["layers.0.attention.wqkv.weight"] for s in shards]  # each [q/2 + kv/2 + kv/2, D]
    for start, size in ((0, q), (q, kv), (q + kv, kv)):
        local = slice(start // 2, (start + size) // 2)
        assert torch.equal(torch.cat([p[local] for p in parts]), wqkv[start : start + size])
    for name in ("layers.1.attention.wo.weight", "layers.1.feed_forward.w2.weight"):
        assert torch.equal(torch.cat([s[name] for s in shards], dim=1), state[name])
    assert torch.equal(torch.cat([s["output.weight"] for s in shards]), state["output.weight"])
    assert all(torch.equal(s["tok_embeddings.weight"], state["tok_embeddings.weight"]) for s in shards)
    for rank in range(2):
        local = Shard(rank, 2).shard_shapes(config, torch.float32)
        assert {n: tuple(t.shape) for n, t in shards[rank].items()} == {n: s for n, (s, _) in local.items()}


@pytest.mark.parametrize("quant", [QuantConfig("int8"), QuantConfig("int4", 32, output=True)], ids=["int8", "int4"])
def test_quantized_shards_dequantize_to_the_slices_of_the_whole(quant):
    config = dataclasses.replace(TINY, intermediate_size=128, tie_embeddings=True)
    state = quantize_state(random_weights(config, torch.float32, seed=0), config, quant, torch.float32)

    def dequantized(tensors: dict, prefix: str) -> torch.Tensor:
        if quant.mode == "int8":
            return dequantize_int8(tensors[f"{prefix}.weight"], tensors[f"{prefix}.scales"])
        parts = (tensors[f"{prefix}.{s}"] for s in ("weight", "scales", "zeros"))
        return dequantize_int4(*parts, quant.group_size)

    shards = [Shard(rank, 2).slice_state(state, config) for rank in range(2)]
    for prefix, dim in (("layers.0.attention.wo", 1), ("layers.1.feed_forward.w2", 1), ("output", 0)):
        if prefix == "output" and not quant.output:
            continue
        joined = torch.cat([dequantized(s, prefix) for s in shards], dim=dim)
        torch.testing.assert_close(joined, dequantized(state, prefix), rtol=0, atol=0)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return make_random_checkpoint(TINY, tmp_path_factory.mktemp("tiny"), dtype=torch.float32, seed=1).parent


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_checkpoint):
    """MHA and GQA, tied and untied heads, a vocabulary that does not split (the head stays whole), int8 and int4."""
    folder = tmp_path_factory.mktemp("checkpoints")
    mha = dataclasses.replace(TINY, n_local_heads=4)
    configs = {
        "mha": mha,
        "mha-tied": dataclasses.replace(mha, tie_embeddings=True),
        "gqa-tied-odd-vocab": dataclasses.replace(TINY, tie_embeddings=True, vocab_size=515),
        "gqa-bias-qknorm": dataclasses.replace(TINY, qkv_bias=True, qk_norm=True),
    }
    made = {"gqa": tiny_checkpoint}
    for name, config in configs.items():
        made[name] = make_random_checkpoint(config, folder / name, dtype=torch.float32, seed=2).parent
    quantizable = dataclasses.replace(TINY, intermediate_size=128)
    source = make_random_checkpoint(quantizable, folder / "float", dtype=torch.float32, seed=3).parent
    for quant in (QuantConfig("int8"), QuantConfig("int4", 32, output=True)):
        made[quant.mode] = quantize_checkpoint(source, folder / quant.mode, quant).parent
    return made


def reference(folder: Path) -> dict:
    """The unsplit model's greedy tokens and window logits (the worker's, in one process)."""
    engine = Engine.load(folder, device="cpu")
    tokens = engine.generate_ids(PROMPT, 12, SamplingConfig(temperature=0), ignore_eos=True).tokens[0]
    model = engine.model
    model.setup_caches(1, 64)
    logits = model(torch.tensor([WINDOW]), torch.arange(len(WINDOW)))[0]
    return {"tokens": tokens, "logits": logits}


def worker_spec(tmp_path: Path, **fields) -> Path:
    spec = {"tp": 2, "compile": "none", "prompt": PROMPT, "window": WINDOW, "new_tokens": 12}
    spec |= fields | {"out": str(tmp_path / "out.json")}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def check_split_matches_whole(checkpoints: dict, tmp_path: Path, compile_mode: str, names: list[str]) -> None:
    folders = [str(checkpoints[name]) for name in names]
    done = torchrun(2, str(WORKER), str(worker_spec(tmp_path, checkpoints=folders, compile=compile_mode)))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())
    for name, folder in zip(names, folders, strict=True):
        expected = reference(Path(folder))
        assert results[folder]["tokens"] == expected["tokens"], name
        torch.testing.assert_close(torch.tensor(results[folder]["logits"]), expected["logits"], rtol=1e-5, atol=1e-5)
        assert len(results[folder]["sampled"]) == 12


def test_two_ranks_give_the_unsplit_tokens_and_logits(checkpoints, tmp_path):
    check_split_matches_whole(checkpoints, tmp_path, "none", list(checkpoints))


@pytest.mark.slow
def test_two_compiled_ranks_give_the_unsplit_tokens_and_logits(checkpoints, tmp_path):
    check_split_matches_whole(checkpoints, tmp_path, "default", ["gqa", "mha-tied"])


def test_an_error_in_one_rank_ends_every_rank(checkpoints, tmp_path):
    spec = worker_spec(tmp_path, checkpoints=[str(checkpoints["gqa"])], fail_rank=1)
    done = torchrun(2, str(WORKER), str(spec))
    assert done.returncode != 0
    assert "RuntimeError: rank 1 fails on purpose" in done.stderr
    assert not (tmp_path / "out.json").exists()


def test_generate_tp_prints_once_and_matches_one_process(tiny_checkpoint, tmp_path, capsys):
    args = ["generate", "--checkpoint_path", str(tiny_checkpoint), "--device", "cpu", "--temperature", "0"]
    args += ["--max_new_tokens", "10", "--num_samples", "1", "--prompt", "Hello"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--metrics_json", str(tmp_path / "one.json")])
    assert exit_info.value.code == 0
    single = capsys.readouterr().out
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "gpt_fast", *args, "--tp", "2", "--metrics_json", str(tmp_path / "two.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Time to load model") == 1 and "Tensor parallel over 2 ranks" in done.stdout
    text = next(line for line in single.splitlines() if line.startswith("Hello"))
    assert done.stdout.splitlines().count(text) == 1
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["samples"][0]["generated_ids"] == one["samples"][0]["generated_ids"]


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4], ids=["world2", "world4"])
@pytest.mark.parametrize(
    "compile_mode, kernel", [("none", "torch"), ("reduce-overhead", "torch"), ("reduce-overhead", "triton")]
)
def test_llama_2_7b_split_over_the_gpus_decodes_as_one_gpu(compile_mode, kernel, world, tmp_path):
    """bf16, against the whole model in float32: the split model's logits no further from it (mean absolute
    difference) than twice the whole bf16 model's, and each of its greedy tokens the float32 model's best or within
    bf16 rounding of it (a near-tie may break the other way). The split model rounds each rank's partial sums to
    bf16 before the all-reduce: a few roundings more per layer than the whole model, of the same size. ``kernel``:
    the linear layers' and attention's decode kernels (ours in Triton, or PyTorch's code), for both models."""
    if GPUS < world:
        pytest.skip(f"needs {world} CUDA or ROCm GPUs, {GPUS} here")
    if kernel == "triton" and not triton_usable(torch.device("cuda")):
        pytest.skip("our decode kernels need Triton on a CUDA GPU")
    kernels = {"linear_kernel": kernel, "attention_kernel": kernel}
    check_split_shape(tmp_path, "llama-2-7b", world, compile_mode, timeout=480, kernels=kernels)


@pytest.mark.gpu
def test_the_ranks_leave_after_decoding_in_cuda_graphs(tmp_path):
    """A CUDA graph that captured a collective keeps NCCL's communicator, and leaving the group waits for it: the
    ranks hang at exit unless the compiled graphs are released first. A small model, so that the hang shows in
    seconds (the timeout fails the test)."""
    if GPUS < 2:
        pytest.skip(f"needs 2 CUDA or ROCm GPUs, {GPUS} here")
    check_split_shape(tmp_path, "tiny", 2, "reduce-overhead", timeout=240)


def check_split_shape(
    tmp_path: Path, shape: str, world: int, compile_mode: str, timeout: float, kernels: dict | None = None
) -> None:
    spec = worker_spec(tmp_path, shape=shape, tp=world, compile=compile_mode, new_tokens=32, kernels=kernels or {})
    done = torchrun(world, str(WORKER), str(spec), timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["split_error"] <= 2 * result["whole_error"], result
    assert max(result["argmax_shortfall"]) <= 0.05 * result["logit_scale"], result


@pytest.mark.parametrize("rank", [0, 1])
def test_a_layer_of_our_kernels_sums_its_partial_products_with_the_residual_added_by_the_first_rank(rank):
    """Connected after its kernels are chosen, a layer that runs one row through our fused kernels runs it through
    :class:`ParallelRow`: ``wo`` and ``w2`` are all-reduced, and only rank 0 adds the residual into its partial
    product (the sum holds it once). Its numbers: the GPU test of the 7B shape split with our kernels."""
    model = Transformer(TINY)
    use_linear_kernel(model, "triton")
    group = type("Group", (), {"group_name": "tp"})()
    TensorParallel(Ranks(rank, 2, rank), group).connect(model, TINY)
    for block in model.layers:
        assert block.row_kernels is ParallelRow
        for product in (block.attention.wo, block.feed_forward.w2):
            assert product.group_name == "tp" and product.first == (rank == 0)


@pytest.mark.slow
@needs_triton
@old_numpy
@pytest.mark.parametrize("heads", [2, 4], ids=["gqa", "mha"])
def test_two_ranks_of_our_fused_kernels_give_the_whole_models_step(heads, tmp_path):
    """Our GEMVs in Triton's interpreter, split over two gloo ranks through :class:`ParallelRow` and compiled
    (Dynamo, eager backend): the one-token step's logits are the whole model's own (its PyTorch code) within float32
    rounding. Each layer made four products on each rank, the norms inside them, and only rank 0 added the
    residuals (the all-reduce sums them once)."""
    config = dataclasses.asdict(dataclasses.replace(TINY, n_local_heads=heads))
    spec = worker_spec(tmp_path, fused=config)
    done = torchrun(2, str(WORKER), str(spec), TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())  # each rank's, in rank order
    assert len(results) == 2
    for rank, result in enumerate(results):
        added = " plus residual" if rank == 0 else ""
        layer = ["linear_gemv normed", f"linear_gemv{added}", "gated_gemv normed", f"linear_gemv{added}"]
        assert result["calls"] == layer * TINY.n_layer and result["error"] < 1e-5, result


def test_several_prompts_and_a_gpu_index_are_refused_with_tp():
    with pytest.raises(ValueError, match="several prompts .* do not run with tensor parallelism"):
        EngineOptions(tp=2).check_batching()
    with pytest.raises(ValueError, match="each rank uses the GPU of its LOCAL_RANK"):
        device_of(torch.device("cuda", 1), None)


@pytest.mark.slow
def test_ctrl_c_stops_every_rank(tiny_checkpoint):
    """Ctrl-C in a terminal (SIGINT to the whole process group): every process ends, exit status 130."""
    command = [sys.executable, "-m", "gpt_fast", "generate", "--checkpoint_path", str(tiny_checkpoint), "--tp", "2"]
    command += ["--device", "cpu", "--max_new_tokens", "400", "--num_samples", "100", "--no_stream"]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env}
    process = subprocess.Popen(command, start_new_session=True, **pipes)
    next(line for line in process.stdout if line.startswith("Sample 1/"))
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 130 and err.rstrip().endswith("error: interrupted")
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)  # nothing of the group is left
