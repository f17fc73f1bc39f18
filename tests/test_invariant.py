"""Batch-invariant steps (``--batch_invariant``): each operator's row does not depend on the other rows; the model's
logits over k + 1 positions equal, bit for bit, those of k + 1 one-position steps, for every family feature the
operators cover; speculative decoding then gives plain decoding's tokens in bfloat16, eager and compiled; the
operators agree with the model's usual code; the engine refuses what they do not cover. The Triton kernels are
checked in Triton's interpreter where Triton is installed (``invariant_reference.py``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpt_fast.accel.invariant import (
    INVARIANT_ROWS,
    InvariantLinear,
    invariant_linear,
    invariant_rms_norm,
    reference_attention,
    reference_linear,
    reference_rms_norm,
    use_invariant_kernels,
)
from gpt_fast.accel.options import KernelOptions
from gpt_fast.cli.main import flag_of
from gpt_fast.convert.random_init import make_random_checkpoint, random_weights
from gpt_fast.engine.engine import Engine, EngineOptions
from gpt_fast.generation.drafters import PromptLookup, Replay
from gpt_fast.generation.options import SpeculativeOptions
from gpt_fast.generation.sampling import SamplingConfig
from gpt_fast.model.config import QuantConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import Transformer, rms_norm
from gpt_fast.util.options import OptionError
from tests.interpreter import interpret_all

GREEDY = SamplingConfig(temperature=0)
TINY = dataclasses.replace(get_shape("tiny"), vocab_size=128)
REFERENCE = Path(__file__).resolve().parent / "invariant_reference.py"
# the family features the invariant operators meet: biases, q/k norms, Gemma's norms, windows and caps, MHA, ties
FEATURES = {
    "llama gqa": {},
    "mha, tied": {"n_local_heads": 4, "tie_embeddings": True},
    "qwen2 biases": {"qkv_bias": True},
    "qk norms": {"qk_norm": True, "n_head": 8, "head_dim": 8},  # a verify step's 80 head rows
    "gemma-2": {
        "norm_offset": 1.0,
        "post_norms": True,
        "mlp_activation": "gelu_tanh",
        "embedding_scale": 8.0,
        "sliding_window": 4,
        "layer_types": ("sliding_attention", "full_attention"),
        "attn_logit_softcap": 50.0,
        "final_logit_softcap": 30.0,
        "query_pre_attn_scalar": 16,
        "tie_embeddings": True,
    },
}


def rows_one_at_a_time(op, x: torch.Tensor, *args) -> torch.Tensor:
    return torch.cat([op(x[i : i + 1], *args) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_operator_gives_a_row_what_it_gives_it_alone(dtype):
    torch.manual_seed(0)
    x, weight, bias = torch.randn(9, 96, dtype=dtype), torch.randn(40, 96, dtype=dtype), torch.randn(40, dtype=dtype)
    assert torch.equal(reference_linear(x, weight, bias), rows_one_at_a_time(reference_linear, x, weight, bias))
    norm_weight = torch.randn(96, dtype=dtype)
    for offset in (0.0, 1.0):
        whole = reference_rms_norm(x, norm_weight, 1e-5, offset)
        assert torch.equal(whole, rows_one_at_a_time(reference_rms_norm, x, norm_weight, 1e-5, offset))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_operators_compute_what_the_model_computes(dtype):
    """Against the usual code over all rows at once: equal to rounding (the order of a sum may differ)."""
    torch.manual_seed(1)
    x, weight, bias = torch.randn(5, 64, dtype=dtype), torch.randn(24, 64, dtype=dtype), torch.randn(24, dtype=dtype)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}
    torch.testing.assert_close(reference_linear(x, weight, bias), F.linear(x, weight, bias), **tolerance)
    norm_weight = torch.randn(64, dtype=dtype)
    for offset in (0.0, 1.0):
        expected = rms_norm(x, norm_weight, 1e-5, offset)
        torch.testing.assert_close(reference_rms_norm(x, norm_weight, 1e-5, offset), expected, **tolerance)


@pytest.mark.parametrize("window, softcap", [(None, None), (6, 20.0)])
def test_the_attention_operator_matches_the_model_and_writes_the_cache(window, softcap):
    """Three query positions per row, each row at its own positions, in cache rows 1 and 2: the keys and values
    written, and each query's output against the model's masked attention over the same cache."""
    torch.manual_seed(2)
    bsz, seqlen, n_head, n_kv, head_dim, length = 2, 3, 4, 2, 8, 16
    q = torch.randn(bsz, seqlen, n_head, head_dim)
    k, v = torch.randn(bsz, seqlen, n_kv, head_dim), torch.randn(bsz, seqlen, n_kv, head_dim)
    positions = torch.tensor([[5, 6, 7], [9, 10, 11]])
    angles = torch.randn(bsz, seqlen, head_dim // 2)
    cos, sin = angles.cos(), angles.sin()
    kv = torch.randn(2, 3, n_kv, length, head_dim)
    before = kv.clone()
    out = reference_attention(q, k, v, cos, sin, kv, positions, 1, 0.3, softcap, window)

    from gpt_fast.model.transformer import apply_rope, attend_softcapped

    rotated_k = apply_rope(k, cos, sin)
    for b in range(bsz):
        for t in range(seqlen):
            assert torch.equal(kv[0, 1 + b, :, positions[b, t]], rotated_k[b, t])
            assert torch.equal(kv[1, 1 + b, :, positions[b, t]], v[b, t])
    untouched = torch.ones(length, dtype=torch.bool)
    untouched[positions.flatten()] = False
    assert torch.equal(kv[:, 0], before[:, 0]) and torch.equal(kv[:, 1:, :, untouched], before[:, 1:, :, untouched])
    key_pos = torch.arange(length)
    seen = key_pos <= positions[..., None]
    if window is not None:
        seen &= positions[..., None] - key_pos < window
    mask = torch.where(seen, 0.0, float("-inf"))[:, None]  # [B, 1, T, S]
    rotated_q = apply_rope(q, cos, sin).transpose(1, 2)
    keys, values = kv[0, 1:], kv[1, 1:]
    if softcap is None:
        expected = F.scaled_dot_product_attention(rotated_q, keys, values, attn_mask=mask, enable_gqa=True, scale=0.3)
    else:
        expected = attend_softcapped(rotated_q, keys, values, mask, 0.3, softcap)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


def random_model(config, dtype: torch.dtype, invariant: bool, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3).add_(1.0 if name.endswith("norm.weight") else 0.0)
    if invariant:
        use_invariant_kernels(model, torch.device("cpu"))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("feature", FEATURES)
@torch.no_grad()
def test_a_verify_forward_gives_each_position_the_logits_of_its_own_decode_step(feature, dtype):
    """After the same prefill, one forward over five positions (two rows, as a verify step) against five
    one-position steps of a fresh copy: bit for bit."""
    config = dataclasses.replace(TINY, **FEATURES[feature])
    tokens = torch.randint(0, config.vocab_size, (2, 15), generator=torch.Generator().manual_seed(3))
    logits = []
    for one_at_a_time in (False, True):
        model = random_model(config, dtype, invariant=True)
        model.setup_caches(2, 32)
        model(tokens[:, :10], torch.arange(10), from_start=True)
        if one_at_a_time:
            logits.append(torch.cat([model(tokens[:, i : i + 1], torch.tensor([i])) for i in range(10, 15)], dim=1))
        else:
            logits.append(model(tokens[:, 10:], torch.arange(10, 15)))
    assert torch.equal(logits[0], logits[1])


def test_the_model_s_linear_layers_norms_and_attention_are_swapped_sharing_their_weights():
    config = dataclasses.replace(TINY, tie_embeddings=True)
    model = random_model(config, torch.float32, invariant=False)
    weight = model.layers[0].attention.wqkv.weight
    use_invariant_kernels(model, torch.device("cpu"))
    assert isinstance(model.layers[0].attention.wqkv, InvariantLinear)
    assert model.layers[0].attention.wqkv.weight is weight
    assert set(model.state_dict()) == set(Transformer(config).state_dict())
    assert model.norm.kernel is invariant_rms_norm and model.head_kernel is invariant_linear
    assert all(layer.attention.rows_kernel is not None for layer in model.layers)


def test_more_rows_than_the_operators_take_use_the_usual_kernels():
    torch.manual_seed(4)
    x, weight = torch.randn(1, INVARIANT_ROWS + 1, 32), torch.randn(16, 32)
    assert torch.equal(invariant_linear(x, weight, None), F.linear(x, weight))
    norm_weight = torch.randn(32)
    assert torch.equal(invariant_rms_norm(x, norm_weight, 1e-5, 0.0), rms_norm(x, norm_weight, 1e-5, 0.0))


def near_tie_engine(compile: str, batch_invariant: bool = True) -> Engine:
    """The tiny shape in float32 whose output projection's rows differ by 1e-6 relative: every argmax is decided at
    the last bits of the logits, where a matrix product over five rows and five over one round differently."""
    state = random_weights(TINY, torch.float32, seed=5)
    generator = torch.Generator().manual_seed(6)
    shared = torch.randn(1, TINY.dim, generator=generator)
    state["output.weight"] = shared + 1e-6 * torch.randn(TINY.vocab_size, TINY.dim, generator=generator)
    options = EngineOptions(compile=compile, device="cpu", dtype="float32", batch_invariant=batch_invariant)
    return Engine.from_state(TINY, state, options)


PROMPT = [7, 8, 9, 10, 11, 12] * 4


def plain_and_speculative(engine: Engine) -> tuple[list[int], list[int], list[int], float]:
    """Plain decoding's tokens; prompt lookup's; and a replay's of plain decoding's own continuation (every proposal
    should be kept), with its acceptance rate. Plain decoding is recorded past the replay's end: rounds the host
    starts beyond the last one it needs count in the acceptance rate too."""
    plain = engine.generate_ids(PROMPT, 48, GREEDY, ignore_eos=True).tokens[0]
    lookup = engine.generate_ids(PROMPT, 40, GREEDY, ignore_eos=True, drafter=PromptLookup(2, 4)).tokens[0]
    replay = engine.generate_ids(PROMPT, 32, GREEDY, ignore_eos=True, drafter=Replay(PROMPT + plain, 4))
    return plain[:40], lookup, replay.tokens[0], replay.speculative.acceptance_rate


@pytest.mark.parametrize("compile", ["none", pytest.param("default", marks=pytest.mark.slow)])
def test_speculation_gives_plain_decoding_s_tokens_where_rounding_decides(compile):
    plain, lookup, replay, acceptance = plain_and_speculative(near_tie_engine(compile))
    assert lookup == plain and replay == plain[:32] and acceptance == 1.0


def test_without_batch_invariance_the_same_speculation_leaves_plain_decoding():
    """The witness that the test above can fail: with the usual kernels on this CPU the verify step's rounding
    flips the near-ties."""
    plain, lookup, replay, acceptance = plain_and_speculative(near_tie_engine("none", batch_invariant=False))
    assert lookup != plain and replay != plain[:32] and acceptance < 1.0


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tp": 2}, "--batch_invariant does not combine with --tp"),
        (
            {"kernels": KernelOptions(attention="triton")},
            "--batch_invariant does not combine with --attention_kernel triton",
        ),
        (
            {"kernels": KernelOptions(activation="triton")},
            "--batch_invariant does not combine with --activation_kernel triton",
        ),
        ({"compile": "default", "aot_precompile": True}, "--batch_invariant does not combine with --aot_precompile"),
    ],
)
def test_options_refuse_what_batch_invariance_does_not_combine_with(options, message):
    """The library names its options; the command line's flags are the same names."""
    with pytest.raises(OptionError) as error:
        EngineOptions(batch_invariant=True, **options)
    assert message in error.value.naming(flag_of)


def test_the_engine_refuses_what_the_operators_do_not_cover():
    options = EngineOptions(device="cpu", batch_invariant=True)
    moe = dataclasses.replace(TINY, n_experts=4, n_active_experts=2)
    with pytest.raises(ValueError, match="--batch_invariant does not cover mixtures of experts yet"):
        Engine.from_state(moe, {}, options)
    with pytest.raises(ValueError, match="--batch_invariant does not cover quantized checkpoints yet"):
        Engine.from_state(TINY, {}, options, quantization=QuantConfig("int8"))
    engine = near_tie_engine("none")
    too_many = INVARIANT_ROWS // 5 + 1
    with pytest.raises(ValueError, match=f"verifies up to {INVARIANT_ROWS} rows per step"):
        engine.generate_ids(PROMPT, 5, GREEDY, batch_size=too_many, drafter=PromptLookup(2, 4))


def test_a_draft_checkpoint_keeps_the_usual_kernels(tmp_path):
    """Only the target's rounding matters: the draft model runs its usual, faster code."""
    make_random_checkpoint(get_shape("tiny"), tmp_path / "target", dtype=torch.float32)
    speculative = SpeculativeOptions(str(tmp_path / "target"), None, 2)
    engine = Engine.open(
        tmp_path / "target", EngineOptions(device="cpu", batch_invariant=True, speculative=speculative)
    )
    engine.load_weights()
    assert isinstance(engine.model.layers[0].attention.wqkv, InvariantLinear)
    assert type(engine.drafter.model.layers[0].attention.wqkv) is torch.nn.Linear


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.skipif(
    tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4),
    reason="Triton 3.6's interpreter takes int() of 1-element arrays, an error since numpy 2.4",
)
def test_the_triton_kernels_in_the_interpreter():
    """Each Triton kernel against the reference operator (to rounding; bfloat16 within an ulp or two, the
    interpreter truncating where the GPU rounds), and each row of a many-row launch equal, bit for bit, to the same
    row launched alone."""
    float32, bfloat16 = (
        json.loads(out) for out in interpret_all([[str(REFERENCE), "cpu", d] for d in ("float32", "bfloat16")])
    )  # a process each
    assert float32["float32"] < 1e-5 and bfloat16["bfloat16"] < 2e-2
    assert float32["rows_alike"] is True and bfloat16["rows_alike"] is True


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("name", ["_rows_linear", "_rows_rms_norm", "_write_rotated"])
def test_the_kernels_compile_for_a_gpu(name):
    """Triton's front end and the GPU compiler type each kernel without a GPU (bfloat16 tensors, the float scalars
    as inductor or Python pass them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gpt_fast.kernels import triton_decode_attention, triton_invariant

    kernel = getattr(triton_invariant, name, None) or getattr(triton_decode_attention, name)
    constants = {
        "_rows_linear": {
            "HAS_BIAS": True,
            "BLOCK_M": 16,
            "BLOCK_N": 32,
            "BLOCK_K": 256,
            "EVEN": False,
            "IEEE": False,
            "UPCAST": False,
        },
        "_rows_rms_norm": {"OFFSET": True, "BLOCK": 1024},
        "_write_rotated": {"H_KV": 8, "HALF": 64, "HALF_PAD": 64},
    }[name]
    signature = {name: "constexpr" if name in constants else "i64" for name in kernel.arg_names}
    signature.update({name: "*bf16" for name in kernel.arg_names if name.endswith("_ptr")})
    signature.update({name: "*i64" for name in kernel.arg_names if name == "pos_ptr"})
    signature.update({name: "*fp32" for name in kernel.arg_names if name in ("cos_ptr", "sin_ptr")})
    signature.update({name: "fp32" for name in kernel.arg_names if name in ("eps", "offset")})
    source = ASTSource(kernel, signature, constexprs=constants)
    assert "cubin" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm
