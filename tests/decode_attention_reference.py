"""The fused decode attention against the model's PyTorch code, shared by the interpreter test (run as a script in a
process of its own, with ``TRITON_INTERPRET=1``: prints the worst errors as JSON) and the GPU tests (imported).

Two levels: the kernel alone against rotary embedding + ``KVCache.update`` (or ``PagedKVCache.update``) +
``attend_one_query`` (the output and the whole cache after the write), and tiny models decoding step by step with the
kernel against the same models without it, their compiled-step code taken eagerly (``torch.compiler.is_compiling``
made true): plain Llama, GQA, q/k norms, sliding windows with soft-capping, head_dim 96, rows of the cache decoded
each at its own position, and a paged cache.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from unittest import mock

import torch

from gpt_fast.model.cache import BlockTable, KVCache, PagedKVCache
from gpt_fast.model.config import ModelConfig
from gpt_fast.model.shapes import get_shape
from gpt_fast.model.transformer import Transformer, apply_rope, attend_one_query

# (batch, cache rows, heads, kv heads, head_dim, cache length, positions, first row, window, softcap, launch)
# positions: [p] shared by the rows, or [[p0], [p1], ...] each row's own; launch: (block_s, split_len, warps,
# max_splits[, dot, mma16, acc_pos])
CASES = [
    (1, 1, 4, 4, 128, 64, [0], 0, None, None, None),  # MHA, the first position
    (1, 1, 4, 4, 128, 512, [511], 0, None, None, None),  # the last position, 16 splits of 32
    (1, 1, 4, 1, 64, 300, [299], 0, None, None, (16, 64, 4, 32)),  # MQA, ragged splits
    (2, 2, 9, 3, 64, 256, [200], 0, None, None, None),  # SmolLM2's GQA (3 query heads per kv head), shared position
    (2, 3, 6, 2, 96, 300, [[5], [299]], 1, None, None, (8, 32, 2, 32)),  # Phi-3's head_dim, rows at their own positions
    # a sliding window across splits; 18 splits of 16, more than COMBINE_ALL: the combination reads each row's
    # position first (TRIM), over 1, 9 and 18 splits (a ragged chunk of splits, a whole one)
    (3, 3, 8, 2, 128, 288, [[0], [130], [287]], 0, 100, None, None),
    (1, 2, 4, 2, 16, 64, [[40]], 1, 4, 50.0, (8, 16, 1, 32)),  # Gemma-like: window and soft-capping, a later row
    (2, 2, 9, 3, 64, 512, [[7], [390]], 0, None, None, (16, 16, 4, 4)),  # at most 4 splits: 16 and 112 positions
    (1, 1, 4, 2, 64, 512, [500], 0, 100, None, (16, 32, 4, 3)),  # 3 splits of 192, the first two before the window
    (1, 1, 16, 16, 128, 512, [300], 0, None, None, None),  # many kv heads (Llama-2-7B's tile): one step per split
    (2, 2, 4, 4, 128, 300, [[5], [290]], 0, None, None, (128, 1024, 4, 16)),  # a many-row step's tile: one split
    # GQA on the tensor cores (bfloat16; float32 takes the reductions): 9 splits of 32, a window over 3 of 5 splits
    # with soft-capping, 7 query heads per kv head (Qwen2.5's), one split of 1024 in loop steps of 16
    (2, 2, 8, 2, 64, 288, [[287], [40]], 0, None, None, (32, 32, 4, 16, True)),
    (1, 2, 8, 4, 64, 160, [[150]], 1, 70, 30.0, (16, 32, 4, 8, True)),
    (2, 2, 14, 2, 128, 100, [[99], [3]], 0, None, None, (16, 1024, 4, 16, True)),
    # float16 operands where the cache is float8 (TF32 on 16-bit caches): GQA with a window and soft-capping; MHA
    # padded to 16 query rows; MHA with its weighted values per position, in one split and in several with a window
    (1, 2, 8, 4, 64, 160, [[150]], 1, 70, 30.0, (16, 32, 4, 8, True, True)),
    (2, 2, 4, 4, 128, 300, [[5], [290]], 0, None, None, (64, 1024, 2, 16, True, True)),
    (2, 2, 4, 4, 128, 300, [[5], [290]], 0, None, None, (128, 1024, 4, 16, False, False, True)),
    (1, 2, 4, 4, 64, 100, [[90]], 1, 30, 20.0, (16, 32, 4, 8, False, False, True)),
]
# (batch, table rows, heads, kv heads, head_dim, max_seq_length, block size, positions, first row, window, softcap,
# launch, rows on the sink): positions [[p0], [p1], ...], each row's own; the rows on the sink (indices of the batch)
# have no block of their own, the others a block for each of their positions, in a shuffled order
PAGED_CASES = [
    (4, 4, 8, 2, 32, 100, 16, [[0], [37], [99], [5]], 0, None, None, None, [3]),  # GQA, 4 splits of 32 positions
    (3, 4, 4, 4, 16, 72, 12, [[3], [50], [71]], 1, 10, 30.0, (8, 16, 1, 4), []),  # blocks of 12, window, soft-cap
    (2, 2, 4, 1, 64, 600, 16, [[590], [20]], 0, None, None, (16, 16, 4, 32), []),  # MQA: 19 of 32 splits, trimmed
    (2, 2, 4, 4, 128, 304, 16, [[290], [6]], 0, None, None, (128, 1024, 4, 16), []),  # a many-row step's tile
    (3, 3, 8, 2, 64, 200, 16, [[150], [17], [0]], 0, None, None, (32, 64, 4, 8, True), [2]),  # tensor cores (GQA)
    (3, 3, 8, 2, 64, 200, 16, [[150], [17], [0]], 0, None, None, (32, 64, 4, 8, True, True), [2]),  # float16's
    (2, 2, 4, 4, 128, 304, 16, [[290], [6]], 0, None, None, (64, 1024, 2, 16, True, True), []),  # MHA, 16 rows
    (2, 2, 4, 4, 128, 304, 16, [[290], [6]], 0, None, None, (128, 1024, 4, 16, False, False, True), []),  # per position
]


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    input_pos: torch.Tensor,
    first_row: int,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """The model's PyTorch code for one query position per row (the mask built as ``Transformer.forward`` and
    ``sliding_inputs`` build it); returns [B, 1, H, D] and leaves the new key and value in ``cache`` (a
    :class:`KVCache` or a :class:`PagedKVCache`)."""
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, 1, D]
    keys, values = cache.update(input_pos, k, v, first_row)  # [B, H_kv, S, D]
    key_pos = torch.arange(keys.shape[2], device=q.device)
    mask = torch.where(key_pos <= input_pos[..., None], 0.0, float("-inf"))  # [1, S] or [B, 1, S]
    if window is not None:
        mask = torch.where(input_pos[..., None] - key_pos < window, mask, float("-inf"))
    if input_pos.dim() == 2:
        mask = mask[:, None]
    return attend_one_query(q, keys, values, mask.to(q.dtype), scale=scale, softcap=softcap).transpose(1, 2)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def step_inputs(
    bsz: int,
    n_head: int,
    n_kv: int,
    head_dim: int,
    length: int,
    positions: list,
    dtype: torch.dtype,
    device: str,
    exact_in: torch.dtype | None = None,
) -> tuple[tuple[torch.Tensor, ...], torch.Generator]:
    """A decode step's random queries [B, 1, H, D], keys and values [B, 1, H_kv, D] in ``dtype`` (views of one
    projection, as the model's), rotary tables [1 or B, 1, D/2] and positions [1] or [B, 1]; and the generator,
    for the cache's keys and values. ``exact_in``: the new keys and values exact in that dtype, and no rotation
    (angles 0), so that writing them into a cache of it rounds nothing."""
    generator = torch.Generator().manual_seed(length + head_dim)
    qkv = torch.randn(bsz, 1, (n_head + 2 * n_kv) * head_dim, generator=generator).to(device, dtype)
    if exact_in is not None:
        qkv = qkv.to(exact_in).to(dtype)
    q, k, v = qkv.split([n_head * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    q, k, v = q.view(bsz, 1, n_head, head_dim), k.view(bsz, 1, n_kv, head_dim), v.view(bsz, 1, n_kv, head_dim)
    angles = 6 * torch.rand(length, head_dim // 2, generator=generator).to(device)
    if exact_in is not None:
        angles.zero_()
    input_pos = torch.tensor(positions, device=device)
    return (q, k, v, angles.cos()[input_pos], angles.sin()[input_pos], input_pos), generator


def compared(
    kernel: Callable[..., torch.Tensor],
    cache: KVCache | PagedKVCache,
    inputs: tuple[tuple[torch.Tensor, ...], torch.Generator],
    first_row: int,
    window: int | None,
    softcap: float | None,
    launch: tuple | None,
) -> tuple[float, float]:
    """The kernel's step (given the cache's block table where it is paged) against :func:`reference_attention`'s on
    ``cache``, filled with random keys and values: the relative error of the output and the worst of an element of
    the cache after the write."""
    from gpt_fast.kernels.triton_decode_attention import Launch

    (q, k, v, cos, sin, input_pos), generator = inputs
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=generator))
    kv = cache.kv.clone()
    scale = q.shape[-1] ** -0.5
    expected = reference_attention(q, k, v, cos, sin, cache, input_pos, first_row, scale, softcap, window)
    extra = {} if launch is None else {"launch": Launch(*launch)}
    table = () if cache.blocks is None else (cache.blocks,)
    got = kernel(q, k, v, cos, sin, kv, input_pos, first_row, scale, softcap, window, *table, **extra)
    assert got.shape == expected.shape and got.dtype == q.dtype
    difference = (kv.double() - cache.kv.double()).abs() / cache.kv.double().abs().clamp(min=1e-30)
    return relative_error(got, expected), difference.max().item()


def kernel_errors(
    kernel: Callable[..., torch.Tensor],
    dtype: torch.dtype,
    device: str,
    cases: list[tuple] = CASES,
    cache_dtype: torch.dtype | None = None,
    exact: bool = False,
) -> tuple[float, float]:
    """The worst relative error of the output and of an element of the cache, over ``cases``; the cache in
    ``cache_dtype`` (None: ``dtype``), the new keys and values exact in it with ``exact`` (:func:`step_inputs`)."""
    worst = (0.0, 0.0)
    exact_in = cache_dtype if exact else None
    for case in cases:
        bsz, rows, n_head, n_kv, head_dim, length, positions, first_row, window, softcap, launch = case
        inputs = step_inputs(bsz, n_head, n_kv, head_dim, length, positions, dtype, device, exact_in)
        cache = KVCache(rows, n_kv, length, head_dim, dtype=cache_dtype or dtype, device=device)
        errors = compared(kernel, cache, inputs, first_row, window, softcap, launch)
        worst = tuple(max(pair) for pair in zip(worst, errors, strict=True))
    return worst


def shuffled_table(table: BlockTable, positions: list, first_row: int, sink: list[int]) -> int:
    """Fill ``table``: each row of the batch (from ``first_row`` on, but those in ``sink``) a block for each of its
    positions up to its own, taken in a shuffled order; the rest the sink, block 0. Returns the blocks in use, the
    sink included."""
    size = table.block_size
    counts = [0 if row in sink else p // size + 1 for row, (p,) in enumerate(positions)]
    order = torch.randperm(sum(counts), generator=torch.Generator().manual_seed(size)) + 1
    for row, blocks in zip(range(first_row, first_row + len(counts)), order.split(counts), strict=True):
        table.blocks[row, : len(blocks)] = blocks
    return 1 + sum(counts)


def paged_kernel_errors(
    kernel: Callable[..., torch.Tensor],
    dtype: torch.dtype,
    device: str,
    cases: list[tuple] = PAGED_CASES,
    cache_dtype: torch.dtype | None = None,
    heads_major: bool = False,
    exact: bool = False,
) -> tuple[float, float]:
    """:func:`kernel_errors` over a paged cache (``cases`` as :data:`PAGED_CASES`, the layout ``heads_major`` says),
    two spare blocks in it."""
    worst = (0.0, 0.0)
    exact_in = cache_dtype if exact else None
    for case in cases:
        bsz, rows, n_head, n_kv, head_dim, length, size, positions, first_row, window, softcap, launch, sink = case
        inputs = step_inputs(bsz, n_head, n_kv, head_dim, length, positions, dtype, device, exact_in)
        table = BlockTable(rows, length, size, device=device)
        blocks = shuffled_table(table, positions, first_row, sink) + 2
        cache = PagedKVCache(
            blocks, table, n_kv, head_dim, dtype=cache_dtype or dtype, device=device, heads_major=heads_major
        )
        errors = compared(kernel, cache, inputs, first_row, window, softcap, launch)
        worst = tuple(max(pair) for pair in zip(worst, errors, strict=True))
    return worst


def model_configs() -> dict[str, ModelConfig]:
    """Tiny models with each feature the kernel takes over: GQA, q/k norms, sliding windows with soft-capping
    (Gemma 2), head_dim 96 with every layer sliding (Phi-3)."""
    tiny = dataclasses.replace(get_shape("tiny"), block_size=128, n_layer=2)
    small = {"dim": 64, "n_layer": 2, "vocab_size": 300, "block_size": 128, "intermediate_size": 32}
    gemma = get_shape("gemma-2-9b")
    phi = get_shape("phi-3-mini-4k")
    return {
        "tiny": tiny,
        "qwen3": dataclasses.replace(get_shape("qwen3-8b"), n_head=4, n_local_heads=2, head_dim=16, **small),
        "gemma-2": dataclasses.replace(
            gemma, n_head=4, n_local_heads=2, head_dim=16, sliding_window=5, layer_types=gemma.layer_types[:2], **small
        ),
        "phi-3": dataclasses.replace(
            phi, n_head=2, n_local_heads=2, head_dim=96, sliding_window=6, layer_types=phi.layer_types[:2], **small
        ),
    }


@torch.no_grad()
def decoded_logits(
    model: Transformer, kernel: Callable[..., torch.Tensor] | None, rows_apart: bool, paged: bool = False
) -> torch.Tensor:
    """Logits of 5 decode steps after a 7-token prompt, with the compiled steps' attention code: 2 rows at one
    position, or (``rows_apart``) each row prefilled alone and then decoded at its own position; in a static cache,
    or a ``paged`` one of blocks of 8 positions, each row's in a shuffled order."""
    generator = torch.Generator().manual_seed(1)
    device = model.tok_embeddings.weight.device
    tokens = torch.randint(0, model.config.vocab_size, (2, 40), generator=generator).to(device)
    model.setup_caches(1, 8)
    model.setup_caches(2, 64, blocks=18 if paged else None, block_size=8)  # a fresh, zeroed cache
    if paged:  # the sink, a spare block and the rows' 16
        model.block_table.blocks.copy_(torch.randperm(16, generator=generator).view(2, 8) + 1)
    for layer in model.layers:
        layer.attention.decode_kernel = kernel
    starts = [7, 13] if rows_apart else [7, 7]
    for row, start in enumerate(starts):
        model(tokens[row : row + 1, :start], torch.arange(start, device=device), first_row=row)
    steps = []
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        for step in range(5):
            positions = [[start + step] for start in starts] if rows_apart else [7 + step]
            steps.append(model(tokens[:, step + 20 : step + 21], torch.tensor(positions, device=device)))
    return torch.cat(steps, dim=1)


def random_model(config: ModelConfig, device: str = "cpu") -> Transformer:
    """A model of ``config`` with weights large enough (std 0.3) that the logits differ clearly."""
    torch.manual_seed(0)
    model = Transformer(config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.to(device).eval()


def model_errors(kernel: Callable[..., torch.Tensor], device: str = "cpu", kv_dtype_name: str | None = None) -> float:
    """The worst relative error of the decoded logits with the kernel, over :func:`model_configs` (float32); the
    rows at their own positions, in a static cache and in a paged one, with the first model. ``kv_dtype_name``:
    the caches' dtype (None: the model's), as ``--kv_cache_dtype`` names it."""
    worst = 0.0
    for name, config in model_configs().items():
        model = random_model(config, device)
        model.kv_dtype_name = kv_dtype_name
        for rows_apart, paged in [(False, False), (True, False), (True, True)] if name == "tiny" else [(False, False)]:
            expected = decoded_logits(model, None, rows_apart, paged)
            worst = max(worst, relative_error(decoded_logits(model, kernel, rows_apart, paged), expected))
    return worst


PARTS = ("float32", "bfloat16", "models")
PAGED = "paged-"  # a part's prefix: the kernel over a paged cache (PAGED_CASES)
FLOAT8 = "float8"  # a part: a bfloat16 model's float8 cache, the new keys and values exact in it


def main(parts: tuple[str, ...] = PARTS) -> None:
    """The worst errors of each of ``parts`` (the kernel in float32, in bfloat16: output and cache, over a static
    cache, or over a paged one as ``paged-float32``, ``paged-bfloat16``; ``float8``, ``paged-float8``: a bfloat16
    model's float8 cache, whose writes must round nothing here, since Triton 3.6's interpreter rounds to float8
    without carrying into the exponent (1.97 to 1.0); tiny models decoding with it), as JSON."""
    from gpt_fast.kernels.triton_decode_attention import decode_attention

    report: dict[str, object] = {}
    for part in parts:
        errors = paged_kernel_errors if part.startswith(PAGED) else kernel_errors
        name = part.removeprefix(PAGED)
        if part == "models":
            report[part] = model_errors(decode_attention)
        elif name == FLOAT8:
            cache = torch.float8_e4m3fn
            report[part] = list(errors(decode_attention, torch.bfloat16, "cpu", cache_dtype=cache, exact=True))
        else:
            report[part] = list(errors(decode_attention, getattr(torch, name), "cpu"))
    json.dump(report, sys.stdout)


if __name__ == "__main__":  # python decode_attention_reference.py [PART ...]
    main(tuple(sys.argv[1:]) or PARTS)
