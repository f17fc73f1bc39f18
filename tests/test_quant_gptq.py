"""GPTQ against plain references: the output error it reaches against round-to-nearest, its rounding against the
textbook update (an explicit inverse of the remaining columns' Hessian at every step, in float64), the
least-squares refit of the grids against a direct minimization, and the asymmetric target against a direct
least-squares solve and plain GPTQ."""

import pytest
import torch

from gpt_fast.quant.gptq import asymmetric_target, gptq_int4, hessian, refit_grids
from gpt_fast.quant.schemes import INT4_MID, dequantize_int4, dequantize_levels, fit_int4, unpack_int4


def correlated_layer(rows: int, cols: int, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight [rows, cols] and inputs [tokens, cols] whose features are correlated and of unequal
    scales, as a trained model's activations are."""
    generator = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=generator) / cols**0.5 + torch.eye(cols)
    scale = torch.rand(cols, generator=generator) * 3 + 0.1
    x = (torch.randn(tokens, cols, generator=generator) @ mix) * scale
    return torch.randn(rows, cols, generator=generator), x


def min_max_rtn(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Plain round-to-nearest int4 on each group's min..max range, dequantized (float64)."""
    groups = w.double().reshape(w.shape[0], -1, group_size)
    low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    scale = (high - low) / 15
    return (torch.round((groups - low) / scale).clamp(0, 15) * scale + low).reshape(w.shape)


def output_error(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> float:
    """‖W Xᵀ − Q Xᵀ‖ / ‖W Xᵀ‖, in float64."""
    x = x.double()
    return ((w.double() - q.double()) @ x.T).norm().item() / (w.double() @ x.T).norm().item()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_output_error_of_round_to_nearest(group_size, act_order):
    w, x = correlated_layer(96, 256, 1024)
    packed, scales, zeros = gptq_int4(w, hessian(x), group_size, torch.float32, act_order=act_order)
    gptq = output_error(w, dequantize_int4(packed, scales, zeros, group_size), x)
    plain = output_error(w, min_max_rtn(w, group_size), x)
    assert gptq < 0.85 * plain
    # and better than our own data-free rounding (range search and refits), which it starts from
    assert gptq < 0.9 * output_error(w, dequantize_int4(*fit_and_pack(w, group_size), group_size), x)


def fit_and_pack(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    levels, scales, zeros = fit_int4(w, group_size, torch.float32)
    return levels[:, 0::2] | (levels[:, 1::2] << 4), scales, zeros


def textbook_gptq(w: torch.Tensor, h: torch.Tensor, group_size: int, damp: float, act_order: bool) -> torch.Tensor:
    """Levels [N, K] of GPTQ as first written (Optimal Brain Quantization, one column at a time, no Cholesky, no
    lazy batches): after rounding column i, the columns F not yet rounded move by
    ``-(w_i - q_i) * inv(H_F)[i, F] / inv(H_F)[i, i]``, with ``inv(H_F)`` inverted explicitly in float64. In
    order, each group's grid is fitted to its columns as updated when the first of them comes; with act-order the
    columns go by decreasing ``H[i, i]`` and every grid is fitted to the weights before any update."""
    w = w.double().clone()
    h = h.double() + damp * h.diagonal().double().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    levels = torch.empty_like(w)
    cols = w.shape[1]
    order = sorted(range(cols), key=lambda i: -h[i, i].item()) if act_order else list(range(cols))
    _, scales, zeros = fit_int4(w.float(), group_size, torch.float32)
    scales, zeros = scales.double(), zeros.double()
    for step, i in enumerate(order):
        if not act_order and i % group_size == 0:
            _, scale, zero = fit_int4(w[:, i : i + group_size].float(), group_size, torch.float32)
            scales[:, i // group_size], zeros[:, i // group_size] = scale[:, 0].double(), zero[:, 0].double()
        scale, zero = scales[:, i // group_size], zeros[:, i // group_size]
        q = torch.round((w[:, i] - zero) / scale + INT4_MID).clamp(0, 15)
        levels[:, i] = q
        rest = order[step:]  # the columns not yet rounded, i first
        inverse = torch.linalg.inv(h[rest][:, rest])
        error = w[:, i] - ((q - INT4_MID) * scale + zero)
        w[:, rest] -= error[:, None] * inverse[0] / inverse[0, 0]
    return levels


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_rounds_as_the_textbook_update(act_order):
    w, x = correlated_layer(24, 192, 512, seed=1)
    h = hessian(x)
    packed, _, _ = gptq_int4(w, h, 64, torch.float32, act_order=act_order, refit=False)
    expected = textbook_gptq(w, h, 64, damp=0.01, act_order=act_order)
    agree = (unpack_int4(packed).double() == expected).double().mean().item()
    assert agree > 0.99  # float32 against float64: a level may flip where a value sits on a rounding boundary


def test_refit_minimizes_the_output_error_for_fixed_levels():
    """Against a direct least-squares solve of one row in float64 (its 2G unknowns), and never worse."""
    w, x = correlated_layer(8, 128, 512, seed=2)
    h = hessian(x)
    levels, scales, zeros = fit_int4(w, 32, torch.float32)
    new_scales, new_zeros = refit_grids(w, h, levels, scales, zeros, 32)
    design = torch.zeros(128, 8, dtype=torch.float64)
    for k in range(128):
        design[k, k // 32] = levels[0, k].double() - INT4_MID
        design[k, 4 + k // 32] = 1.0
    solved = torch.linalg.lstsq(x.double() @ design, x.double() @ w[0].double()).solution
    torch.testing.assert_close(new_scales[0].double(), solved[:4], rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(new_zeros[0].double(), solved[4:], rtol=1e-3, atol=1e-5)
    before = output_error(w, dequantize_levels(levels, scales, zeros, 32), x)
    after = output_error(w, dequantize_levels(levels, new_scales, new_zeros, 32), x)
    assert after < before


def test_inputs_that_are_always_zero_get_zero_weight_and_no_nan():
    w, x = correlated_layer(16, 64, 256, seed=3)
    x[:, :5] = 0
    packed, scales, zeros = gptq_int4(w, hessian(x), 32, torch.float32, act_order=True)
    q = dequantize_int4(packed, scales, zeros, 32)
    assert torch.isfinite(q).all()
    assert output_error(w, q, x) < output_error(w, min_max_rtn(w, 32), x)


def drifted(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` [n, K] as quantized layers before might leave it: mixed a little across features, plus noise."""
    generator = torch.Generator().manual_seed(seed)
    mix = torch.eye(x.shape[1]) + 0.01 * torch.randn(x.shape[1], x.shape[1], generator=generator)
    return x @ mix + 0.05 * x.std() * torch.randn(x.shape, generator=generator)


def test_the_asymmetric_target_is_the_least_squares_fit_to_the_float_outputs():
    """Without a ridge, the target is the direct least-squares solve of ``X̃ W'ᵀ ≈ X Wᵀ`` (float64); with inputs
    that did not drift, it is the weight itself."""
    w, x = correlated_layer(16, 64, 512, seed=4)
    noisy = drifted(x, seed=5)
    exact = torch.linalg.lstsq(noisy.double(), x.double() @ w.double().T).solution.T
    target = asymmetric_target(w, x, noisy, ridge=0.0)
    torch.testing.assert_close(target.double(), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(asymmetric_target(w, x, x), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_on_the_asymmetric_target_comes_closer_to_the_float_outputs(act_order):
    """‖W X − Q X̃‖ (X the float inputs, X̃ the drifted ones) below plain GPTQ's on ``hessian(X̃)``."""
    w, x = correlated_layer(96, 256, 1024)
    noisy = drifted(x, seed=6)
    h = hessian(noisy)
    targets = {"plain": w, "asymmetric": asymmetric_target(w, x, noisy)}
    error = {}
    for name, target in targets.items():
        q = dequantize_int4(*gptq_int4(target, h, 32, torch.float32, act_order=act_order), 32).double()
        reference = w.double() @ x.double().T
        error[name] = ((reference - q @ noisy.double().T).norm() / reference.norm()).item()
    assert error["asymmetric"] < 0.8 * error["plain"], error
