"""The decoder layers of one decode step (one token, batch 1) as one persistent Triton kernel.

A compiled decode step of a small model is bound by launches, not bytes: SmolLM2-135M's step runs about 420
kernels per token, each a few microseconds of latency for a few kilobytes of weights (BENCHMARKS.md). Here one
kernel runs every layer: as many programs as the GPU has multiprocessors, each taking its share of every phase
of a layer, with a grid-wide barrier between phases. Five phases per layer:

0. the attention norm (each program normalizes the whole residual for itself: a few KB) and the ``wqkv`` rows,
   in pairs of rows that the rotary embedding rotates together; queries to a scratch buffer, keys and values
   into the cache at the step's position;
1. attention: each query head's positions in runs, a program per (head, run), each leaving its run's softmax
   maximum, sum and weighted values (online softmax);
2. the runs combined, then the ``wo`` rows, plus the residual;
3. the MLP norm and the ``w13`` rows, in (gate, up) pairs, through SiLU and their product;
4. the ``w2`` rows, plus the residual.

Each program holds its whole share of a phase's weight rows at once (:func:`layers_launch`; a model too large for
that is refused: the kernel is for small models) and loads them before waiting at the phase's barrier, so that the
weights' latency overlaps the wait.

Values are rounded to the model's dtype where the model's PyTorch code rounds them (every product's result, the
rotary embedding's, the norm's), and reduced in float32. A program reads what others wrote through L2
(``.cg`` loads), after the barrier: an arrival counter in global memory, released and acquired at GPU scope.

Triton's interpreter runs a launch's programs one after another, so a barrier would wait forever there: with
``phase`` set, a launch runs that one phase of one layer and no barrier (the CPU tests launch phase by phase);
on a GPU one launch runs them all. Every program must be resident at once for the barrier: one program per
multiprocessor, eight warps (on an H200, 132 programs of 8 warps run the default model's 30 layers in 560 µs; 4 or
16 warps, or fewer programs, are slower: docs/bench/HISTORY.md, 2026-11-24a).

Imported only where Triton is; the launcher runs on CUDA tensors, and in the interpreter on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpt_fast.kernels import persistent_table

PHASES = tl.constexpr(5)  # per layer
TABLE_COLUMNS = tl.constexpr(persistent_table.TABLE_COLUMNS)


@triton.jit
def _grid_sync(bar_ptr, target):
    """Wait until ``target`` arrivals (this one included) have been counted at ``bar_ptr``; none for 0. A scalar
    atomic runs once per program; the CTA barrier before it orders every thread's stores before the release."""
    if target > 0:
        tl.debug_barrier()
        tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


@triton.jit
def _pointer(table, layer, column, dtype: tl.constexpr):
    return tl.load(table + layer * TABLE_COLUMNS + column).to(tl.pointer_type(dtype))


@triton.jit
def _tile(w_ptr, rows, inside, K, BLOCK: tl.constexpr):
    """Rows ``rows`` [R] of ``w`` [N, K], whole: [R, BLOCK] (zeros outside)."""
    kk = tl.arange(0, BLOCK)
    inside = inside[:, None] & (kk < K)[None, :]
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :], mask=inside, other=0.0)


@triton.jit
def _vector(ptr, K, BLOCK: tl.constexpr):
    """A vector [K] another program wrote (read through L2), in float32: [BLOCK] (zeros past K)."""
    kk = tl.arange(0, BLOCK)
    return tl.load(ptr + kk, mask=kk < K, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _normed(x, norm_ptr, K, eps, BLOCK: tl.constexpr):
    """RMSNorm of ``x`` [BLOCK] (float32, zeros past K) as the model rounds it: ``weight * (x / rms)``, each
    factor and the product in the model's dtype."""
    dtype = norm_ptr.dtype.element_ty
    kk = tl.arange(0, BLOCK)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    weight = tl.load(norm_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    return (weight * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _dot(w, v, dtype: tl.constexpr):
    """Rows [R, BLOCK] times a vector [BLOCK], reduced in float32 and rounded to ``dtype``: [R] float32."""
    return tl.sum(w.to(tl.float32) * v[None, :], axis=1).to(dtype).to(tl.float32)


@triton.jit
def _normed_pair(w_ptr, first, second, inside, x_ptr, norm_ptr, bar_ptr, target, DIM, eps, BLOCK_D: tl.constexpr):
    """Rows ``first`` and ``second`` [R] of ``w`` [N, DIM], loaded before the barrier, times the vector at ``x_ptr``
    RMS-normalized, read after it: two [R] float32 of values rounded to the model's dtype."""
    w_first = _tile(w_ptr, first, inside, DIM, BLOCK_D)
    w_second = _tile(w_ptr, second, inside, DIM, BLOCK_D)
    _grid_sync(bar_ptr, target)
    v = _normed(_vector(x_ptr, DIM, BLOCK_D), norm_ptr, DIM, eps, BLOCK_D)
    dtype = x_ptr.dtype.element_ty
    return _dot(w_first, v, dtype), _dot(w_second, v, dtype)


@triton.jit
def _share(units, pid, P, ROWS: tl.constexpr):
    """This program's units of a phase ([ROWS], at most ``ceil(units / P)`` of them) and which are real."""
    per = tl.cdiv(units, P)
    u = pid * per + tl.arange(0, ROWS)
    return u, (u < pid * per + per) & (u < units)


@triton.jit
def _qkv_phase(
    x_ptr, table, layer, q_ptr, cos_ptr, sin_ptr, bar_ptr, target, pos, eps, pid, P, DIM, S,
    N_HEAD: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Phase 0: normed x times wqkv, in pairs of rows (i, i + HEAD_DIM / 2) of one head; q and k rotated. The
    weights are loaded before the barrier."""
    dtype = x_ptr.dtype.element_ty
    w_ptr = _pointer(table, layer, 0, dtype)
    HALF: tl.constexpr = HEAD_DIM // 2
    u, inside = _share((N_HEAD + 2 * N_KV) * HALF, pid, P, ROWS)
    head = u // HALF
    i = u % HALF
    row = head * HEAD_DIM + i
    norm_ptr = _pointer(table, layer, 4, dtype)
    a, b = _normed_pair(w_ptr, row, row + HALF, inside, x_ptr, norm_ptr, bar_ptr, target, DIM, eps, BLOCK_D)
    rotated = inside & (head < N_HEAD + N_KV)
    cos = tl.load(cos_ptr + pos * HALF + i, mask=rotated, other=1.0)
    sin = tl.load(sin_ptr + pos * HALF + i, mask=rotated, other=0.0)
    first_half = (a * cos - b * sin).to(dtype)
    second_half = (b * cos + a * sin).to(dtype)
    is_q = inside & (head < N_HEAD)
    tl.store(q_ptr + row, first_half, mask=is_q)
    tl.store(q_ptr + row + HALF, second_half, mask=is_q)
    kind = (head >= N_HEAD + N_KV).to(tl.int64)  # 0: key, 1: value
    kv_head = tl.where(kind == 0, head - N_HEAD, head - N_HEAD - N_KV)
    at = _pointer(table, layer, 6, dtype) + ((kind * N_KV + kv_head) * S + pos) * HEAD_DIM + i
    is_kv = inside & (head >= N_HEAD)
    tl.store(at, first_half, mask=is_kv)
    tl.store(at + HALF, second_half, mask=is_kv)


@triton.jit
def _attention_phase(
    table, layer, q_ptr, part_ptr, bar_ptr, target, pos, scale, pid, P, S,
    N_HEAD: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Phase 1: each query head's positions 0 .. ``pos`` in ``SPLITS`` consecutive runs, a program for each (head,
    run): the run's softmax maximum, sum and weighted values ``part`` [N_HEAD * SPLITS, HEAD_DIM + 2] in float32
    (combined in phase 2)."""
    _grid_sync(bar_ptr, target)
    dtype = q_ptr.dtype.element_ty
    kv_ptr = _pointer(table, layer, 6, dtype)
    d = tl.arange(0, HEAD_DIM)
    run = tl.cdiv(pos + 1, SPLITS)
    for unit in range(pid, N_HEAD * SPLITS, P):
        head = unit // SPLITS
        begin = (unit % SPLITS) * run
        stop = tl.minimum(begin + run, pos + 1)
        kv_head = head // (N_HEAD // N_KV)
        q = tl.load(q_ptr + head * HEAD_DIM + d, cache_modifier=".cg").to(tl.float32)
        keys = kv_ptr + kv_head * S * HEAD_DIM
        values = kv_ptr + (N_KV + kv_head) * S * HEAD_DIM
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
        for s0 in range(begin, stop, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            seen = s < stop
            at = s.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
            k = tl.load(keys + at, mask=seen[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
            v = tl.load(values + at, mask=seen[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
            scores = tl.where(seen, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
        row = part_ptr + unit * (HEAD_DIM + 2)
        tl.store(row + d, acc)
        tl.store(row + HEAD_DIM, m_i)
        tl.store(row + HEAD_DIM + 1, l_i)


@triton.jit
def _attention_output(
    part_ptr, N_HEAD: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr, dtype
):  # fmt: skip
    """The attention's output [BLOCK_Q] (float32 of values rounded to ``dtype``; zeros past N_HEAD * HEAD_DIM) from
    phase 1's runs: each run's weighted values rescaled to the head's maximum, over the sum."""
    HEADS: tl.constexpr = BLOCK_Q // HEAD_DIM
    RUNS: tl.constexpr = triton.next_power_of_2(SPLITS)
    h = tl.arange(0, HEADS)[:, None]
    j = tl.arange(0, RUNS)[None, :]
    real = (h < N_HEAD) & (j < SPLITS)
    rows = part_ptr + (h * SPLITS + j) * (HEAD_DIM + 2)  # [HEADS, RUNS]
    m = tl.load(rows + HEAD_DIM, mask=real, other=float("-inf"), cache_modifier=".cg")
    l_run = tl.load(rows + HEAD_DIM + 1, mask=real, other=0.0, cache_modifier=".cg")
    d = tl.arange(0, HEAD_DIM)[None, None, :]
    acc = tl.load(rows[:, :, None] + d, mask=real[:, :, None], other=0.0, cache_modifier=".cg")
    top = tl.max(m, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)[:, None]  # heads past N_HEAD: no run
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))  # [HEADS, RUNS]
    total = tl.sum(weight * l_run, axis=1)
    out = tl.sum(weight[:, :, None] * acc, axis=1) / tl.where(total == 0.0, 1.0, total)[:, None]
    return tl.reshape(out.to(dtype).to(tl.float32), (BLOCK_Q,))


@triton.jit
def _residual_phase(
    table, layer, column, in_ptr, res_ptr, out_ptr, bar_ptr, target, pid, P, DIM, K,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, ATTENTION: tl.constexpr, N_HEAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Phases 2 and 4: ``out = res + W @ in`` for this program's rows of W (wo or w2), each rounded; W loaded
    before the barrier. ``in`` is the vector [K] there, or (``ATTENTION``) phase 1's runs, combined here."""
    dtype = res_ptr.dtype.element_ty
    rows, inside = _share(DIM, pid, P, ROWS)
    w = _tile(_pointer(table, layer, column, dtype), rows, inside, K, BLOCK_K)
    _grid_sync(bar_ptr, target)
    if ATTENTION:
        v = _attention_output(in_ptr, N_HEAD, HEAD_DIM, SPLITS, BLOCK_K, dtype)
    else:
        v = _vector(in_ptr, K, BLOCK_K)
    y = _dot(w, v, dtype)
    res = tl.load(res_ptr + rows, mask=inside, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + rows, (res + y).to(dtype), mask=inside)


@triton.jit
def _mlp_phase(
    h_ptr, table, layer, act_ptr, bar_ptr, target, eps, pid, P, DIM, INTER,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Phase 3: normed h times w13 in (gate i, up i) pairs, then silu(gate) * up, each rounded; w13 loaded before
    the barrier."""
    dtype = h_ptr.dtype.element_ty
    w_ptr = _pointer(table, layer, 2, dtype)
    u, inside = _share(INTER, pid, P, ROWS)
    norm_ptr = _pointer(table, layer, 5, dtype)
    gate, up = _normed_pair(w_ptr, u, u + INTER, inside, h_ptr, norm_ptr, bar_ptr, target, DIM, eps, BLOCK_D)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(act_ptr + u, (silu * up).to(dtype), mask=inside)


@triton.jit
def _arrivals(layers_done, phase: tl.constexpr, P, SYNC: tl.constexpr):
    """The arrivals the barrier opening ``phase`` of the launch's layer ``layers_done`` waits for: one per program
    for each phase run before it in this launch; 0 (no barrier) for the launch's first phase, or without ``SYNC``."""
    return (layers_done * PHASES + phase) * P * SYNC


@triton.jit
def _decode_layers(
    x_ptr, h_ptr, q_ptr, part_ptr, act_ptr, table, cos_ptr, sin_ptr, pos_ptr, bar_ptr,
    first_layer, end_layer, eps, scale, DIM, INTER, S,
    N_HEAD: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PHASE: tl.constexpr,
    ROWS_QKV: tl.constexpr, ROWS_O: tl.constexpr, ROWS_MLP: tl.constexpr, ROWS_DOWN: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLITS: tl.constexpr,
):  # fmt: skip
    """Layers ``first_layer`` .. ``end_layer - 1`` on the residual ``x`` [DIM] in place (``PHASE`` -1: every phase,
    each but the first starting at a barrier; else that phase alone, no barrier)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    pos = tl.load(pos_ptr)
    SYNC: tl.constexpr = PHASE == -1
    for layer in range(first_layer, end_layer):
        done = layer - first_layer  # layers this launch ran before this one
        if SYNC or PHASE == 0:
            _qkv_phase(x_ptr, table, layer, q_ptr, cos_ptr, sin_ptr, bar_ptr, _arrivals(done, 0, P, SYNC),
                       pos, eps, pid, P, DIM, S, N_HEAD, N_KV, HEAD_DIM, ROWS_QKV, BLOCK_D)  # fmt: skip
        if SYNC or PHASE == 1:
            _attention_phase(table, layer, q_ptr, part_ptr, bar_ptr, _arrivals(done, 1, P, SYNC), pos,
                             scale, pid, P, S, N_HEAD, N_KV, HEAD_DIM, SPLITS, BLOCK_S)  # fmt: skip
        if SYNC or PHASE == 2:
            _residual_phase(table, layer, 1, part_ptr, x_ptr, h_ptr, bar_ptr, _arrivals(done, 2, P, SYNC), pid, P,
                            DIM, N_HEAD * HEAD_DIM, ROWS_O, BLOCK_Q, True, N_HEAD, HEAD_DIM, SPLITS)  # fmt: skip
        if SYNC or PHASE == 3:
            _mlp_phase(h_ptr, table, layer, act_ptr, bar_ptr, _arrivals(done, 3, P, SYNC), eps, pid, P,
                       DIM, INTER, ROWS_MLP, BLOCK_D)  # fmt: skip
        if SYNC or PHASE == 4:
            _residual_phase(table, layer, 3, act_ptr, h_ptr, x_ptr, bar_ptr, _arrivals(done, 4, P, SYNC),
                            pid, P, DIM, INTER, ROWS_DOWN, BLOCK_I, False, N_HEAD, HEAD_DIM, SPLITS)  # fmt: skip


@dataclass(frozen=True)
class Launch:
    """Rows per program of each phase (wqkv pairs, wo rows, w13 pairs, w2 rows: every program's whole share) and
    the padded lengths of the model's dimension, the queries' and the MLP's."""

    rows_qkv: int
    rows_o: int
    rows_mlp: int
    rows_down: int
    block_d: int
    block_q: int
    block_i: int

    @property
    def largest_tile(self) -> int:
        """Weights one program holds at once, in elements: a phase's tiles."""
        return max(
            2 * self.rows_qkv * self.block_d, self.rows_o * self.block_q, 2 * self.rows_mlp * self.block_d,
            self.rows_down * self.block_i,
        )  # fmt: skip


def layers_launch(shape: tuple[int, int, int, int], dim: int, programs: int) -> Launch:
    """The tiles for (n_head, n_kv, head_dim, intermediate size) and ``dim`` over ``programs`` programs."""
    n_head, n_kv, head_dim, inter = shape

    def rows(units: int) -> int:
        return triton.next_power_of_2(triton.cdiv(units, programs))

    return Launch(
        rows((n_head + 2 * n_kv) * head_dim // 2), rows(dim), rows(inter), rows(dim),
        triton.next_power_of_2(dim), triton.next_power_of_2(n_head * head_dim), triton.next_power_of_2(inter),
    )  # fmt: skip


MAX_TILE = 32768  # elements of weights a program holds at once (layers_launch): more spills registers
WARPS = 8
BLOCK_S = 64  # cached positions per step of the attention's loop


def decode_layers(
    x: torch.Tensor,
    table: torch.Tensor,
    input_pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    shape: tuple[int, int, int, int, int],
    eps: float,
    scale: float,
    programs: int,
    phase_by_phase: bool = False,
    warps: int = WARPS,
) -> torch.Tensor:
    """The residual ``x`` [1, 1, DIM] after the layers in ``table`` [L, TABLE_COLUMNS] (data pointers, see
    :func:`gpt_fast.accel.persistent.fill_pointer_table`), for the token at ``input_pos`` [1]; ``cos``/``sin``
    [S, HEAD_DIM / 2] float32; ``shape`` (n_head, n_kv, head_dim, intermediate size, cache length). ``programs``:
    the grid (every one resident at once); ``phase_by_phase``: a launch per phase and layer, no barrier (Triton's
    interpreter); ``warps`` per program."""
    n_head, n_kv, head_dim, inter, max_seq = shape
    dim = x.numel()
    out = x.reshape(dim).clone()
    h = torch.empty_like(out)
    q = out.new_empty(n_head * head_dim)
    splits = max(1, programs // n_head)  # runs of positions per head in the attention phase
    part = torch.empty(n_head * splits * (head_dim + 2), dtype=torch.float32, device=x.device)
    act = out.new_empty(inter)
    bar = torch.zeros(1, dtype=torch.int32, device=x.device)
    layers = table.shape[0]
    launch = layers_launch((n_head, n_kv, head_dim, inter), dim, programs)
    runs = [(lr, lr + 1, p) for lr in range(layers) for p in range(PHASES)] if phase_by_phase else [(0, layers, -1)]
    for first, end, phase in runs:
        _decode_layers[(programs,)](
            out, h, q, part, act, table, cos, sin, input_pos, bar, first, end, eps, scale, dim, inter, max_seq,
            N_HEAD=n_head, N_KV=n_kv, HEAD_DIM=head_dim, PHASE=phase, ROWS_QKV=launch.rows_qkv, ROWS_O=launch.rows_o,
            ROWS_MLP=launch.rows_mlp, ROWS_DOWN=launch.rows_down, BLOCK_D=launch.block_d, BLOCK_Q=launch.block_q,
            BLOCK_I=launch.block_i, BLOCK_S=BLOCK_S, SPLITS=splits, num_warps=warps,
        )  # fmt: skip
    return out.view_as(x)
