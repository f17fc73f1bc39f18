"""GPTQ for the int4 scheme: round a linear layer's weights so that its *outputs* on calibration inputs change least.

Round-to-nearest (:func:`gpt_fast.quant.schemes.quantize_int4`) minimizes ``‖W - Q‖`` weight by weight. GPTQ
(Frantar et al., 2022) minimizes ``‖(W - Q) X‖`` over the layer's inputs ``X`` [K, n]: its columns are rounded
one at a time, and each column's rounding error is spread over the columns not yet rounded in proportion to how
the inputs correlate, which the Hessian of that error, ``H = X Xᵀ`` [K, K], says. With ``U`` the upper Cholesky
factor of ``H⁻¹``, rounding column ``i`` to ``q`` moves every later column ``j`` by
``-(w_i - q) / U[i, i] * U[i, j]``: the least-squares optimum over those columns given the rounded ones.

- Lazy batches: updates inside a block of :data:`BLOCK` columns are made column by column on that block only; the
  rest of the matrix gets the block's accumulated errors in one product at its end (the same numbers, fewer passes
  over memory).
- Groups are chosen as it goes: when the loop reaches a group's first column, its scale and zero are fitted
  (:func:`gpt_fast.quant.schemes.fit_int4`: range search and least-squares refits) to the group's columns *as the
  updates so far have left them*, so the grid follows the corrected weights.
- Act-order (optional): columns are rounded in order of decreasing ``H[i, i]`` (the inputs of largest energy first,
  while there is most freedom left to compensate). The groups stay the stored ones ("static groups": consecutive
  columns, their scales and zeros fitted to the unrounded weights before the loop), so the checkpoint's layout and
  every kernel are unchanged: nothing is permuted at inference.
- Asymmetric calibration (optional; GPTAQ, Li et al., 2025): calibrated sequentially, a layer's inputs ``X̃`` are
  those the quantized layers before it give, where the float model gave it ``X``; GPTQ on ``W`` and ``H̃ = X̃ X̃ᵀ``
  minimizes ``‖(W - Q) X̃‖``, which forgets ``X``. The asymmetric error ``‖W X - Q X̃‖²`` is, up to a constant,
  ``‖(W' - Q) X̃‖²`` with ``W' = W X X̃ᵀ H̃⁻¹`` (the weights whose outputs on ``X̃`` come closest to ``W``'s on
  ``X``), so GPTQ runs unchanged on that target (:func:`asymmetric_target`), with a ridge towards ``W``.

The result is in the stored format of int4: levels packed two per byte, scales and zeros in the checkpoint's dtype.
"""

from __future__ import annotations

import torch

from gpt_fast.quant.schemes import INT4_MID, dequantize_levels, fit_int4, int4_levels, n_groups, pack_int4

BLOCK = 128  # columns per lazy batch (rounded up to a multiple of the group size)
DAMP = 0.01  # added to H's diagonal, as a fraction of its mean: keeps the factorization stable
REFIT_ROWS = 256  # rows whose grids are refitted at a time
RIDGE = 1e-6  # of the refit's normal equations, as a fraction of their mean diagonal
ASYMMETRIC_RIDGE = 1.0  # of the asymmetric target's least squares, as a fraction of H's mean diagonal


def hessian(inputs: torch.Tensor) -> torch.Tensor:
    """``X Xᵀ`` [K, K] in float32 from a layer's inputs [..., K] (any number of rows)."""
    x = inputs.reshape(-1, inputs.shape[-1]).float()
    return x.T @ x


def asymmetric_target(
    weight: torch.Tensor, float_inputs: torch.Tensor, inputs: torch.Tensor, ridge: float = ASYMMETRIC_RIDGE
) -> torch.Tensor:
    """The weights ``W'`` [N, K] (float32) minimizing ``‖W X - W' X̃‖² + r ‖W' - W‖²``, where ``weight`` is ``W``
    [N, K], ``float_inputs`` and ``inputs`` [..., K] are a layer's inputs ``X`` in the float model and ``X̃`` in
    the partly quantized one (the same tokens), and ``r`` is ``ridge`` times the mean diagonal of ``X̃ X̃ᵀ``:
    ``W' = W (X X̃ᵀ + r I)(X̃ X̃ᵀ + r I)⁻¹``. The ridge keeps the target near ``W`` along the directions the
    calibration inputs barely span, where a least-squares fit on a few thousand tokens is mostly noise (with 0.01
    of the mean diagonal and 4096 tokens, the default model's perplexity is far worse than plain GPTQ's: +18 %
    against +10 %; with 1, +6.4 %; docs/bench/2026-11-23j_quant_gptaq_cpu.txt). In float64, as measured there: the same
    target in float32, different by rounding alone, gives +8.1 % (roundings near ties flip, and the sequential
    calibration carries each flip into the later layers, so one run of that gate is one draw from a spread of a
    point or two)."""
    x = float_inputs.reshape(-1, float_inputs.shape[-1]).double()
    x_q = inputs.reshape(-1, inputs.shape[-1]).double()
    h = x_q.T @ x_q
    identity = torch.eye(h.shape[0], dtype=torch.float64, device=h.device)
    r = ridge * h.diagonal().mean().clamp_min(1e-12)
    return torch.linalg.solve(h + r * identity, (x.T @ x_q + r * identity).T @ weight.double().T).T.float()


def _inverse_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor [K, K] of the inverse of ``h`` damped by ``damp`` times its mean diagonal."""
    h = h.clone()
    h.diagonal().add_(damp * h.diagonal().mean().clamp_min(1e-8))
    # cholesky_solve against the identity: the same inverse as cholesky_inverse, which is 30x slower
    # on the CPU (LAPACK's potri), 4.8 s for a [1536, 1536] matrix
    identity = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    inverse = torch.cholesky_solve(identity, torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True)


def _round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels [N] of column ``w`` [N] on the grid ``scale``, ``zero`` [N] (float32), and the values they stand for."""
    q = int4_levels(w, scale, zero)
    return q, (q - INT4_MID) * scale + zero


def gptq_int4(
    weight: torch.Tensor,
    h: torch.Tensor,
    group_size: int,
    scale_dtype: torch.dtype,
    act_order: bool = False,
    damp: float = DAMP,
    refit: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] (K even) and its inputs' ``h`` [K, K] (:func:`hessian`) -> packed uint8 [N, K/2],
    ``scales`` and ``zeros`` [N, ceil(K/group_size)] in ``scale_dtype``, as
    :func:`gpt_fast.quant.schemes.quantize_int4` returns them."""
    rows, cols = weight.shape
    assert cols % 2 == 0 and h.shape == (cols, cols), "int4 packs two columns per byte; h is [K, K]"
    w = weight.float().clone()
    h = h.float().clone()
    dead = h.diagonal() == 0  # inputs that are always zero: their weights cannot matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    original, original_h = w.clone(), h.clone()
    groups = n_groups(cols, group_size)
    scales = torch.empty(rows, groups, dtype=scale_dtype, device=w.device)
    zeros = torch.empty_like(scales)
    order = torch.arange(cols, device=w.device)
    if act_order:
        _, scales[:], zeros[:] = fit_int4(w, group_size, scale_dtype)
        order = torch.argsort(h.diagonal(), descending=True)
        w, h = w[:, order], h[order][:, order]
    u = _inverse_factor(h, damp)
    levels = torch.empty(cols, rows, device=w.device)  # in rounding order, a column per row
    block = -(-BLOCK // group_size) * group_size
    for start in range(0, cols, block):
        end = min(start + block, cols)
        errors = _block(w, u, start, end, order, levels, scales, zeros, group_size, fit=not act_order)
        w[:, end:] -= errors @ u[start:end, end:]
    stored = torch.empty_like(levels)
    stored[order] = levels
    levels = stored.T.contiguous()  # [N, K]
    if refit:
        scales, zeros = refit_grids(original, original_h, levels, scales, zeros, group_size)
    return pack_int4(levels.to(torch.uint8)), scales, zeros


def _output_error(w: torch.Tensor, h: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``(w - q) H (w - q)ᵀ`` of each row [N]: the squared error of the row's outputs over the inputs of ``h``."""
    e = w - q
    return ((e @ h) * e).sum(dim=1)


def refit_grids(
    w: torch.Tensor,
    h: torch.Tensor,
    levels: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """With the levels [N, K] fixed, the scales and zeros [N, G] that minimize each row's output error
    ``(w - q) H (w - q)ᵀ``: the value of a weight is linear in its group's scale and zero, so each row's 2G of
    them solve a least-squares problem weighted by ``h`` [K, K]. A row keeps its old grid where the new one
    (rounded to the scales' dtype) is not better. Done in chunks of :data:`REFIT_ROWS` rows (bounded memory)."""
    new_scales, new_zeros = scales.clone(), zeros.clone()
    for start in range(0, w.shape[0], REFIT_ROWS):
        rows = slice(start, start + REFIT_ROWS)
        new_scales[rows], new_zeros[rows] = _refit_rows(w[rows], h, levels[rows], scales[rows], zeros[rows], group_size)
    return new_scales, new_zeros


def _refit_rows(
    w: torch.Tensor, h: torch.Tensor, levels: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`refit_grids` of a few rows, in float64 (the normal equations are ill-conditioned: in float32 the
    solution is a few percent off a direct least-squares solve). The design of row n has a scale
    column per group (the levels minus 8 there, zero elsewhere) and a zero column per group (one there)."""
    w, h = w.double(), h.double()
    rows, cols = w.shape
    groups = scales.shape[1]
    member = torch.nn.functional.one_hot(torch.arange(cols, device=w.device) // group_size, groups).double()  # [K, G]
    a = levels.double() - INT4_MID  # [n, K]
    design = a[:, :, None] * member  # [n, K, G]: the scale columns
    # the scale columns times h, [n, G, K], one group at a time: rows x K x K work in all, not G times that
    weighted = torch.stack(
        [a[:, g : g + group_size] @ h[g : g + group_size] for g in range(0, cols, group_size)], dim=1
    )
    zero_weighted = member.T @ h  # [G, K]
    gram = torch.cat(
        [
            torch.cat([weighted @ design, weighted @ member], dim=2),
            torch.cat([(zero_weighted @ design), (zero_weighted @ member).expand(rows, -1, -1)], dim=2),
        ],
        dim=1,
    )  # [n, 2G, 2G]
    target = torch.cat([(weighted @ w[:, :, None])[..., 0], w @ zero_weighted.T], dim=1)  # [n, 2G]
    old = torch.cat([scales.double(), zeros.double()], dim=1)  # [n, 2G]
    # a ridge towards the old grid keeps a group whose levels are all equal (scale and zero not separable) solvable
    ridge = RIDGE * gram.diagonal(dim1=1, dim2=2).mean(dim=1).clamp_min(1e-30)[:, None]  # [n, 1]
    identity = torch.eye(2 * groups, dtype=torch.float64, device=w.device)
    solved = torch.linalg.solve(gram + ridge[:, :, None] * identity, target + ridge * old)
    new_scales, new_zeros = solved[:, :groups].to(scales.dtype), solved[:, groups:].to(zeros.dtype)
    before = _output_error(w, h, dequantize_levels(levels, scales, zeros, group_size).double())
    after = _output_error(w, h, dequantize_levels(levels, new_scales, new_zeros, group_size).double())
    better = (after < before)[:, None]
    return torch.where(better, new_scales, scales), torch.where(better, new_zeros, zeros)


def _block(
    w: torch.Tensor,
    u: torch.Tensor,
    start: int,
    end: int,
    order: torch.Tensor,
    levels: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    fit: bool,
) -> torch.Tensor:
    """Round columns ``start:end`` of ``w`` [N, K] (in rounding order) into ``levels`` [K, N], compensating within
    the block; with ``fit``, each group's grid is fitted into ``scales``, ``zeros`` when its first column comes
    (the block starts on a group boundary and holds whole groups). Return the block's scaled errors [N, B]."""
    block = w[:, start:end].T.contiguous()  # [B, N]: a column per row, contiguous
    errors = torch.empty_like(block)
    for i in range(end - start):
        column = int(order[start + i])
        group = column // group_size
        if fit and i % group_size == 0:
            _, scales[:, group : group + 1], zeros[:, group : group + 1] = fit_int4(
                block[i : i + group_size].T, group_size, scales.dtype
            )
        q, value = _round(block[i], scales[:, group].float(), zeros[:, group].float())
        levels[start + i] = q
        errors[i] = (block[i] - value) / u[start + i, start + i]
        block[i + 1 :] -= u[start + i, start + i + 1 : end, None] * errors[i]
    return errors.T
