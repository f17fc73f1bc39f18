"""The two weight-only schemes, as plain tensor functions: quantize a float matrix, and dequantize it back.

int8: per output channel, symmetric: ``w ≈ q * scale`` with ``q`` in [-127, 127] and ``scale = max|w| / 127``
over the row; or, with a ``group_size``, the same per group of that many consecutive input columns of a row (a
GGUF's ``Q8_0`` blocks are groups of 32: :mod:`gpt_fast.convert.gguf_quant` takes them over as they are).

int4: per group of ``group_size`` consecutive input columns of a row, asymmetric: ``w ≈ (q - 8) * scale + zero``
with ``q`` in [0, 15]. ``zero`` is the value of ``q = 8`` (the convention of PyTorch's own int4 kernels,
``torch.ops.aten._weight_int4pack_mm*``, so that one set of numbers serves every kernel). The range of each group
is searched (:data:`INT4_CLIP_RATIOS`): shrinking it towards the group's mean can lower the squared error, as an
outlier then costs one clipped weight instead of the resolution of all the others; then the scale and zero of each
group are refitted to its levels by least squares and the levels re-rounded (:data:`INT4_REFITS` times), each
group keeping its best candidate. No calibration data; the stored format is the same as plain min/max's.
A row whose length is not a multiple of ``group_size`` ends with a shorter group. Two columns share a byte: column
``2j`` in the low nibble of byte ``j``, column ``2j + 1`` in the high nibble.

Scales and zero points are rounded to the dtype they are stored in *before* the weights are rounded to the grid,
so the integers are the best ones for the numbers actually stored.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
INT4_LEVELS = 16
INT4_MID = 8  # the level whose value is ``zero``
# Fractions of a group's full range tried, keeping the one of least squared error (1.0: plain min/max).
INT4_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
INT4_REFITS = 4  # least-squares refits of each group's scale and zero after the range search
_TINY = 1e-12  # the smallest scale: an all-equal row or group quantizes exactly to its value


def n_groups(in_features: int, group_size: int) -> int:
    """Groups in a row of ``in_features`` columns (the last may be shorter)."""
    return -(-in_features // group_size)


def quantize_int8(
    weight: torch.Tensor, scale_dtype: torch.dtype, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> ``q`` int8 [N, K] and ``scales`` in ``scale_dtype``: [N], or [N, ceil(K/group_size)]
    with a ``group_size``."""
    w = weight.float()
    if group_size is None:
        scales = (w.abs().amax(dim=1) / INT8_MAX).clamp_min(_TINY).to(scale_dtype)
    else:
        scales = (_grouped(w, group_size)[0].abs().amax(dim=2) / INT8_MAX).clamp_min(_TINY).to(scale_dtype)
    column_scales = int8_column_scales(scales.float(), w.shape[1], group_size)
    q = torch.round(w / column_scales).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def int8_column_scales(scales: torch.Tensor, cols: int, group_size: int | None) -> torch.Tensor:
    """The scale of every weight of int8 rows of ``cols`` columns, in ``scales``' dtype, broadcastable to them:
    [..., 1] for per-row ``scales`` [...], [..., cols] for per-group ones [..., G] (the last group may be shorter)."""
    if group_size is None:
        return scales[..., None]
    return scales.repeat_interleave(group_size, dim=-1)[..., :cols]


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """The float32 matrix [N, K] that ``q``, ``scales`` ([N], or [N, groups] of ``group_size``) stand for."""
    return q.float() * int8_column_scales(scales.float(), q.shape[1], group_size)


def _grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] float32 as [N, G, group_size], the last group padded with copies of the row's last column
    (which changes neither its minimum nor its maximum), and which of those columns are real [G, group_size]."""
    rows, cols = w.shape
    pad = n_groups(cols, group_size) * group_size - cols
    real = torch.arange(cols + pad, device=w.device) < cols
    if pad:
        w = torch.cat([w, w[:, -1:].expand(rows, pad)], dim=1)
    return w.reshape(rows, -1, group_size), real.reshape(-1, group_size)


def int4_levels(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The levels (0..15, as floats) nearest to ``values`` on the grid ``scales``, ``zeros`` (float32, broadcast)."""
    return torch.round((values - zeros) / scales + INT4_MID).clamp_(0, INT4_LEVELS - 1)


def _int4_grid(
    groups: torch.Tensor, low: torch.Tensor, high: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scales and zeros [N, G] (rounded to ``dtype``) for ranges ``low..high``, and the levels [N, G, S] of
    ``groups`` on that grid."""
    scales = ((high - low) / (INT4_LEVELS - 1)).clamp_min(_TINY).to(dtype)
    zeros = (low + INT4_MID * scales.float()).to(dtype)
    return int4_levels(groups, scales.float()[..., None], zeros.float()[..., None]), scales, zeros


def _int4_error(
    groups: torch.Tensor, real: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """Squared error [N, G] of levels ``q`` [N, G, S] on the grid ``scales``, ``zeros`` [N, G]; the padding copies
    do not count."""
    error = ((q - INT4_MID) * scales.float()[..., None] + zeros.float()[..., None] - groups).square()
    return (error * real).sum(dim=2)


def _refit(
    groups: torch.Tensor, real: torch.Tensor, q: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The least-squares scale and zero [N, G] of each group for its levels ``q`` [N, G, S] (rounded to
    ``dtype``), and the levels of ``groups`` re-rounded to that grid."""
    count = real.sum(dim=1)  # [G]
    a = (q - INT4_MID) * real
    mean_a, mean_w = a.sum(dim=2) / count, (groups * real).sum(dim=2) / count
    var_a = (a.square().sum(dim=2) / count - mean_a.square()).clamp_min(_TINY)
    cov = (a * groups).sum(dim=2) / count - mean_a * mean_w
    scales = (cov / var_a).clamp_min(_TINY).to(dtype)
    zeros = (mean_w - mean_a * scales.float()).to(dtype)
    return int4_levels(groups, scales.float()[..., None], zeros.float()[..., None]), scales, zeros


def quantize_int4(
    weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] (K even) -> packed ``q`` uint8 [N, K/2], ``scales`` and ``zeros`` [N, ceil(K/group_size)]
    in ``scale_dtype`` (the grid of :func:`fit_int4`)."""
    assert weight.shape[1] % 2 == 0, "int4 packs two columns per byte"
    levels, scales, zeros = fit_int4(weight, group_size, scale_dtype)
    return pack_int4(levels), scales, zeros


def fit_int4(
    weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> levels uint8 [N, K] (0..15), ``scales`` and ``zeros`` [N, ceil(K/group_size)] in
    ``scale_dtype``.

    Data-free: each group keeps, of the clipped ranges of :data:`INT4_CLIP_RATIOS` and then
    :data:`INT4_REFITS` alternations of a least-squares fit of its scale and zero to its levels and a re-rounding
    of its levels to that grid, the candidate of least squared error (so never worse than plain min/max)."""
    rows, cols = weight.shape
    groups, real = _grouped(weight.float(), group_size)  # [N, G, S], [G, S]
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    center = (groups * real).sum(dim=2) / real.sum(dim=1)
    best = None
    candidates = (
        _int4_grid(groups, center + (low - center) * ratio, center + (high - center) * ratio, scale_dtype)
        for ratio in INT4_CLIP_RATIOS
    )
    for q, scales, zeros in candidates:
        best = _keep_better(best, [q, scales, zeros, _int4_error(groups, real, q, scales, zeros)])
    for _ in range(INT4_REFITS):
        q, scales, zeros = _refit(groups, real, best[0], scale_dtype)
        best = _keep_better(best, [q, scales, zeros, _int4_error(groups, real, q, scales, zeros)])
    q, scales, zeros, _ = best
    return q.reshape(rows, -1)[:, :cols].to(torch.uint8), scales, zeros


def _keep_better(best: list | None, candidate: list) -> list:
    """Per group, whichever of ``best`` and ``candidate`` ([levels, scales, zeros, error]) has the lesser error."""
    if best is None:
        return candidate
    better = candidate[3] < best[3]  # [N, G]
    return [
        torch.where(better[..., None], candidate[0], best[0]),
        torch.where(better, candidate[1], best[1]),
        torch.where(better, candidate[2], best[2]),
        torch.minimum(candidate[3], best[3]),
    ]


def pack_int4(levels: torch.Tensor) -> torch.Tensor:
    """Levels [N, K] (uint8, 0..15, K even) -> bytes [N, K/2]: column 2j low nibble, 2j + 1 high nibble."""
    return levels[:, 0::2] | (levels[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [N, K/2] -> levels [N, K] (uint8)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 matrix [N, K] that ``packed``, ``scales``, ``zeros`` stand for."""
    return dequantize_levels(unpack_int4(packed), scales, zeros, group_size)


def dequantize_levels(levels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 matrix [N, K] that unpacked ``levels`` [N, K] stand for with ``scales``, ``zeros`` [N, G]."""
    levels = levels.float()
    cols = levels.shape[1]
    s = scales.float().repeat_interleave(group_size, dim=1)[:, :cols]
    z = zeros.float().repeat_interleave(group_size, dim=1)[:, :cols]
    return (levels - INT4_MID) * s + z
