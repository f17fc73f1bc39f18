"""The quantization schemes: error bounds, the grid they put weights on, packing."""

import pytest
import torch

from gpt_fast.quant.schemes import (
    dequantize_int4,
    dequantize_int8,
    n_groups,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def weights(rows=48, cols=256, seed=0):
    """Gaussian weights with a few outliers, as real projections have."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=generator) * 0.02
    w.view(-1)[torch.randint(0, rows * cols, (20,), generator=generator)] *= 15
    return w


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_error_is_at_most_half_a_step_per_channel(scale_dtype):
    w = weights()
    q, scales = quantize_int8(w, scale_dtype)
    assert q.dtype == torch.int8 and scales.dtype == scale_dtype and scales.shape == (48,)
    assert q.abs().max() <= 127
    error = (dequantize_int8(q, scales) - w).abs()
    step = scales.float()[:, None]
    assert (error <= step / 2 * (1 + 1e-5)).all()  # rounding to the stored scale's grid, never more
    assert (error.amax(dim=1) / w.abs().amax(dim=1)).max() < 1 / 127  # relative to each row's largest weight


def plain_int4_error(w, group_size):
    """Squared error per group of the textbook asymmetric scheme: 16 levels from the group's minimum to its
    maximum (float32 scales), written here independently."""
    groups = w.reshape(w.shape[0], -1, group_size)
    low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    step = (high - low) / 15
    levels = torch.round((groups - low) / step).clamp(0, 15)
    return (low + levels * step - groups).square().sum(dim=2)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_is_no_worse_than_plain_min_max_groups(group_size):
    w = weights()
    q, scales, zeros = quantize_int4(w, group_size, torch.float32)
    assert q.dtype == torch.uint8 and q.shape == (48, 128)
    assert scales.shape == zeros.shape == (48, 256 // group_size)
    ours = (dequantize_int4(q, scales, zeros, group_size) - w).square().reshape(48, -1, group_size).sum(dim=2)
    assert (ours <= plain_int4_error(w, group_size) * (1 + 1e-4) + 1e-12).all()
    assert ours.sum() < plain_int4_error(w, group_size).sum()  # the range search pays where there are outliers
    assert (scales > 0).all()


def heavy_tailed(rows=48, cols=256, seed=0):
    """Student-t weights with 3 degrees of freedom: outliers everywhere, not only a few."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, cols, generator=generator)
    chi2 = torch.randn(3, rows, cols, generator=generator).square().sum(dim=0)
    return normal / (chi2 / 3).sqrt() * 0.02


@pytest.mark.parametrize(
    "make", [lambda: torch.randn(48, 256, generator=torch.Generator().manual_seed(2)), heavy_tailed]
)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_beats_min_max_on_random_and_heavy_tailed_groups(make, group_size):
    """Per group never worse than min/max, clearly better in total, and within min/max's own bound: at most half
    a min/max step per weight, on average over the group."""
    w = make()
    q, scales, zeros = quantize_int4(w, group_size, torch.float32)
    ours = (dequantize_int4(q, scales, zeros, group_size) - w).square().reshape(48, -1, group_size).sum(dim=2)
    plain = plain_int4_error(w, group_size)
    assert (ours <= plain * (1 + 1e-4) + 1e-12).all()
    assert ours.sum() < 0.97 * plain.sum()
    groups = w.reshape(48, -1, group_size)
    half_step = (groups.amax(dim=2) - groups.amin(dim=2)) / 15 / 2
    assert (ours <= group_size * half_step.square() * (1 + 1e-4)).all()


def test_int4_reproduces_weights_already_on_a_4_bit_grid():
    """Groups of 32 holding 16 levels of their own, all used (as a Q4_1 GGUF's weights are): exact."""
    generator = torch.Generator().manual_seed(1)
    levels = torch.randint(0, 16, (8, 4, 32), generator=generator)
    levels[..., 0], levels[..., 1] = 0, 15
    step = torch.rand(8, 4, 1, generator=generator) * 0.01 + 0.001
    low = torch.randn(8, 4, 1, generator=generator) * 0.05
    w = (low + levels * step).reshape(8, 128)
    q, scales, zeros = quantize_int4(w, 32, torch.float32)
    torch.testing.assert_close(dequantize_int4(q, scales, zeros, 32), w, rtol=0, atol=1e-6)


def test_a_row_ends_with_a_shorter_group():
    """576 columns in groups of 128 (SmolLM2's width): four groups of 128 and one of 64."""
    w = weights(cols=576)
    assert n_groups(576, 128) == 5
    q, scales, zeros = quantize_int4(w, 128, torch.float32)
    assert q.shape == (48, 288) and scales.shape == (48, 5)
    error = (dequantize_int4(q, scales, zeros, 128) - w)[:, 512:].square().sum(dim=1)
    assert (error <= plain_int4_error(w[:, 512:], 64)[:, 0] * (1 + 1e-4) + 1e-12).all()


def test_constant_rows_and_groups_are_exact():
    w = torch.full((4, 64), 0.25)
    w[1] = 0.0
    q8, s8 = quantize_int8(w, torch.float32)
    assert torch.equal(dequantize_int8(q8, s8), w)
    q4, s4, z4 = quantize_int4(w, 32, torch.float32)
    torch.testing.assert_close(dequantize_int4(q4, s4, z4, 32), w, rtol=0, atol=1e-7)


def test_int4_packing_puts_even_columns_in_the_low_nibble():
    levels = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = pack_int4(levels)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]
    assert torch.equal(unpack_int4(packed), levels)
    many = torch.randint(0, 16, (5, 40), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(many)), many)


def test_scales_are_rounded_before_the_weights():
    """With bfloat16 scales the levels are the best ones for the bfloat16 numbers actually stored."""
    w = weights(rows=8, cols=64)
    q, scales = quantize_int8(w, torch.bfloat16)
    best = torch.round(w / scales.float()[:, None]).clamp(-127, 127)
    assert torch.equal(q.float(), best)
