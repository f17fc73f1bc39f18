"""GPU-only checks (CUDA or ROCm): every compile mode runs, and the traces show what each mode launches (the PyTorch
attention code in every mode by default); speculative decoding gives plain decoding's greedy tokens in every mode, its
verify step is one CUDA graph launch in ``reduce-overhead``, and sampling with it runs.

Run on a GPU machine with `python -m pytest -q -m gpu tests/test_gpu.py`; skipped without one."""

import json
import subprocess
import sys

import pytest
import torch

from gpt_fast.accel.linear import steps_with_pdl
from gpt_fast.convert.random_init import make_random_checkpoint
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.decode import COMPILE_MODES, make_steps
from gpt_fast.generation.decode import generate as generate_tokens
from gpt_fast.generation.drafters import DraftModel, PromptLookup, Replay
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.jobs.trace_summary import SCOPE_SPECULATIVE, summarize_trace
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import Transformer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")]
NEW_TOKENS = 40
GREEDY = SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_random_checkpoint(get_shape("tiny"), tmp_path_factory.mktemp("tiny"), dtype=torch.bfloat16, seed=3)


def generate(checkpoint, folder, mode, *extra, label=None):
    metrics = folder / f"metrics_{label or mode}.json"
    command = [
        sys.executable,
        "-m",
        "gpt_fast",
        "generate",
        "--checkpoint_path",
        str(checkpoint),
        "--device",
        "cuda",
        "--compile",
        mode,
        "--max_new_tokens",
        str(NEW_TOKENS),
        "--num_samples",
        "3",
        "--temperature",
        "0",
        "--ignore_eos",
        "--no_stream",
        "--metrics_json",
        str(metrics),
        *extra,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(metrics.read_text())


@pytest.fixture(scope="module")
def runs(checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs")
    return {
        mode: generate(checkpoint, folder, mode, "--profile", str(folder / f"trace_{mode}"))
        | {"trace": folder / f"trace_{mode}.json"}
        for mode in COMPILE_MODES
    }


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_every_mode_runs_and_agrees_with_eager(runs, mode):
    eager = runs["none"]["samples"][-1]["generated_ids"]
    samples = runs[mode]["samples"]
    assert all(s["new_tokens"] == NEW_TOKENS and s["tokens_per_sec"] > 0 for s in samples)
    assert samples[-1]["generated_ids"] == eager  # greedy: same tokens, compiled or not
    assert (runs[mode]["compile_seconds"] is None) == (mode == "none")


@pytest.mark.parametrize("extra", [(), ("--regional_compile",)], ids=["whole", "regional"])
def test_heuristic_kernels_agree_with_eager(runs, checkpoint, tmp_path, extra):
    """Kernels left as inductor picks them (no coordinate-descent tuning) in CUDA graphs: eager's greedy tokens."""
    run = generate(checkpoint, tmp_path, "reduce-overhead", "--kernel_tuning", "heuristic", *extra)
    assert run["kernel_tuning"] == "heuristic"
    assert run["samples"][-1]["generated_ids"] == runs["none"]["samples"][-1]["generated_ids"]


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_auto_takes_the_fused_attention_in_the_cuda_graph_modes(runs, mode):
    """``auto`` launches the fused Triton attention in the CUDA-graph modes of a GPU with PDL (where it takes our
    GEMV) and keeps the PyTorch code elsewhere. tests/test_decode_attention_gpu.py checks the kernel's tokens."""
    fused = "_decode_attention_split" in runs[mode]["trace"].read_text()
    assert fused == steps_with_pdl(torch.device("cuda"), mode)


def test_reduce_overhead_launches_one_graph_per_token(runs):
    summary = summarize_trace(runs["reduce-overhead"]["trace"])
    assert summary.tokens == NEW_TOKENS - 1
    assert summary.graph_launches_per_token == pytest.approx(1.0, abs=0.05)
    assert summary.kernel_launches_per_token < 0.1  # no per-kernel launches left in decode
    assert summary.gpu_kernels_per_token > 5  # the graph's kernels still run and are recorded


def test_eager_launches_kernels_and_no_graphs(runs):
    summary = summarize_trace(runs["none"]["trace"])
    assert summary.tokens == NEW_TOKENS - 1
    assert summary.graph_launches == 0
    assert summary.kernel_launches_per_token > 20
    assert summary.gpu_kernels_per_token == pytest.approx(summary.kernel_launches_per_token, rel=0.2)


def test_default_mode_fuses_kernels(runs):
    eager, compiled = summarize_trace(runs["none"]["trace"]), summarize_trace(runs["default"]["trace"])
    assert compiled.graph_launches == 0
    assert compiled.kernel_launches_per_token < eager.kernel_launches_per_token / 2


# --- short prompts' prefills in CUDA graphs ---------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("compile_prefill", [False, True], ids=["eager-prefill", "compiled-prefill"])
def test_short_prefills_replay_from_cuda_graphs_with_eager_tokens(compile_prefill):
    """``reduce-overhead`` captures the prefill (eager, or compiled for every length) of a short prompt padded to 64
    tokens (GraphedPrefill), replays it for another prompt of that padded length, captures again for a longer one
    and for new caches (keeping the old graphs, never replayed again): greedy tokens equal to eager's throughout
    (float32: no near-ties rounded apart)."""
    torch.manual_seed(0)
    model = Transformer(get_shape("tiny"))
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    model = model.to("cuda").eval()
    eager, graphed = make_steps("none"), make_steps("reduce-overhead", compile_prefill=compile_prefill)

    def tokens(prompt, new, steps, sampling=GREEDY):
        return generate_tokens(model, list(prompt), max_new_tokens=new, sampling=sampling, steps=steps).tokens

    captured = []
    # (prompt, new tokens): caches of 64 positions (capture, replay), 128 (new caches: capture, replay), 256
    requests = ((range(1, 21), 12), (range(3, 33), 12), (range(2, 72), 12), (range(5, 80), 12), (range(20), 200))
    for prompt, new in requests:
        assert tokens(prompt, new, graphed) == tokens(prompt, new, eager)
        captured.append([(rows, padded) for _state, rows, padded, _sampling in graphed.prefill.graphs])
    assert captured == [[(1, 64)], [(1, 64)], [(1, 64), (1, 128)], [(1, 64), (1, 128)], [(1, 64), (1, 128), (1, 64)]]
    sampling, runs = SamplingConfig(temperature=1.0, top_k=20), []
    for _ in range(3):  # capture, replay, replay: a seed gives the same samples on replay
        torch.manual_seed(7)
        runs.append(tokens(range(1, 21), 8, graphed, sampling))
    assert runs[1] == runs[2] and all(0 <= t < model.config.vocab_size for t in runs[1][0])


# --- speculative decoding -------------------------------------------------------------------------------------------

SPEC_K = 4


@pytest.fixture(scope="module")
def float32_pair(tmp_path_factory):
    """A target and a draft in float32: greedy tokens are then the same whichever kernels compute them (in
    bfloat16 the verify step's and the decode step's kernels may round an argmax near-tie differently)."""
    folder = tmp_path_factory.mktemp("spec")
    tiny = get_shape("tiny")
    return (
        make_random_checkpoint(tiny, folder / "target", dtype=torch.float32, seed=3),
        make_random_checkpoint(tiny, folder / "draft", dtype=torch.float32, seed=4),
    )


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_speculation_gives_plain_decodings_tokens(float32_pair, mode):
    torch._dynamo.reset()
    options = EngineOptions(compile=mode, device="cuda", dtype="float32")
    engine, draft = (Engine.open(path, options) for path in float32_pair)
    engine.load_weights()
    draft.load_weights()
    prompt = engine.encode("Hello, my name is Hello, my name is")
    recorded = engine.generate_ids(prompt, NEW_TOKENS + 3 * (SPEC_K + 1), GREEDY, ignore_eos=True).tokens[0]
    for batch_size in (1, 2):
        expected = engine.generate_ids(prompt, NEW_TOKENS, GREEDY, ignore_eos=True, batch_size=batch_size).tokens
        assert expected[0] == recorded[:NEW_TOKENS]
        for drafter in (PromptLookup(3, SPEC_K), DraftModel(draft.model, SPEC_K), Replay(prompt + recorded, SPEC_K)):
            for _ in range(2):  # the first run compiles (and records the CUDA graphs), the second replays them
                result = engine.generate_ids(
                    prompt, NEW_TOKENS, GREEDY, ignore_eos=True, batch_size=batch_size, drafter=drafter
                )
                assert result.tokens == expected, drafter.name
        assert result.speculative.acceptance_rate == 1.0  # the replay


def test_sampled_speculation_runs_in_cuda_graphs(float32_pair):
    torch._dynamo.reset()
    options = EngineOptions(compile="reduce-overhead", device="cuda", dtype="float32")
    engine, draft = (Engine.open(path, options) for path in float32_pair)
    engine.load_weights()
    draft.load_weights()
    sampling = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9)
    for drafter in (PromptLookup(2, SPEC_K), DraftModel(draft.model, SPEC_K), DraftModel(engine.model, SPEC_K)):
        for _ in range(2):
            result = engine.generate_ids(
                [1, 2, 3], NEW_TOKENS, sampling, ignore_eos=True, batch_size=2, drafter=drafter
            )
            assert [len(row) for row in result.tokens] == [NEW_TOKENS] * 2
            assert all(0 <= t < engine.model_config.vocab_size for row in result.tokens for t in row)
    assert result.speculative.acceptance_rate > 0.9  # the target drafting for itself: p = q up to rounding


@pytest.fixture(scope="module")
def speculative_traces(checkpoint, tmp_path_factory):
    """`generate --compile reduce-overhead --profile` with prompt lookup and with a draft checkpoint (bfloat16)."""
    folder = tmp_path_factory.mktemp("spec_traces")
    draft = make_random_checkpoint(get_shape("tiny"), folder / "draft", dtype=torch.bfloat16, seed=4)
    out = {}
    for name, extra in (("lookup", ["--prompt_lookup", "2"]), ("draft", ["--draft_checkpoint_path", str(draft)])):
        trace = folder / f"trace_{name}"
        metrics = generate(
            checkpoint, folder, "reduce-overhead", *extra, "--speculate_k", str(SPEC_K), "--profile", str(trace),
            label=name,
        )  # fmt: skip
        out[name] = (metrics, summarize_trace(folder / f"trace_{name}.json"))
    return out


@pytest.mark.parametrize("name, draft_launches", [("lookup", 1), ("draft", SPEC_K)])
def test_a_verify_step_is_one_graph_launch(speculative_traces, name, draft_launches):
    """One CUDA graph per verify step and no kernel launched around it; the drafting is graphs too: one lookup, or
    one per draft-model step."""
    metrics, summary = speculative_traces[name]
    rounds = metrics["samples"][-1]["speculative"]["rounds"]
    assert summary.scope == SCOPE_SPECULATIVE and summary.verify_steps == rounds
    assert summary.verify_graph_launches == rounds and summary.verify_kernel_launches == 0
    assert summary.graph_launches == rounds * (1 + draft_launches)
    assert summary.kernel_launches < 0.1 * rounds


@pytest.mark.parametrize("name", ["gemma-2-9b", "mixtral-8x7b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_family_features_compile_to_eager_greedy_tokens(name, mode):
    """Soft-capping, sliding windows, q/k norms and the experts' gather in the compiled decode step, on the GPU:
    the features of a registered family shape at a tiny size, float32, greedy tokens equal to eager's."""
    from test_bench_decode import shrunk

    from gpt_fast.convert.random_init import random_weights

    shape = shrunk(name)
    state = {n: t * 10 if t.dim() > 1 else t for n, t in random_weights(shape, torch.float32, seed=0).items()}
    greedy = SamplingConfig(temperature=0)
    tokens = {}
    for compile_mode in ("none", mode):
        engine = Engine.from_state(shape, state, EngineOptions(compile=compile_mode, device="cuda", dtype="float32"))
        tokens[compile_mode] = engine.generate_ids(list(range(1, 21)), NEW_TOKENS, greedy).tokens[0]
    assert tokens[mode] == tokens["none"]


ROW_AFTER_ROW = """
import functools, torch
from gpt_fast.bench.decode import Subject, measure, ours_runners, release_memory
from gpt_fast.convert.random_init import random_weights
from gpt_fast.model.config import QuantConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.util.settings import apply_torch_settings

apply_torch_settings()
device, shape = torch.device("cuda"), get_shape("llama-2-7b")
subject = Subject(random_weights(shape, torch.bfloat16, seed=0, device=device), shape, "reduce-overhead", device,
                  torch.bfloat16)
rows = {"bf16": functools.partial(ours_runners, subject),
        "int4 tinygemm": functools.partial(ours_runners, subject, QuantConfig("int4", 128), "aten")}
generator = torch.Generator().manual_seed(0)
prompt, ttft_prompt = (torch.randint(0, shape.vocab_size, (n,), generator=generator).tolist() for n in (64, 256))
for name, build in rows.items():
    print(measure(name, build, prompt, ttft_prompt, 32, 1, device), flush=True)
    release_memory(device)
print("every row measured")
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 40e9,
    reason="needs a GPU with 40 GB",
)
def test_a_row_of_the_decode_bench_after_another_on_the_7b_shape():
    """`gpt-fast bench decode --quantize int4` builds a row's engines after the last row's are freed. On the
    Llama-2-7B shape a row whose prefill multiplies by cuBLAS (here PyTorch's tinygemm row, which dequantizes for
    prefills) must not reuse a cuBLAS workspace from the freed row's CUDA-graph pool: that was an illegal memory
    access at its first generation (docs/bench/HISTORY.md, 2026-11-29)."""
    result = subprocess.run([sys.executable, "-c", ROW_AFTER_ROW], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and "every row measured" in result.stdout, result.stderr[-3000:]
