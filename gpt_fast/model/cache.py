"""Key/value caches, preallocated once and updated in place: static (a row of ``max_seq_length`` positions per
sequence) or paged (blocks of ``block_size`` positions, which each sequence's row of a block table names).

Fixed buffer shapes keep the decode step's shapes fixed, so it compiles once with ``fullgraph=True`` and can be
captured as a CUDA graph (buffers are module state with stable addresses; the block table too, which the host
rewrites in place between steps).
"""

from __future__ import annotations

import torch
from torch import nn


def stored(kv: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv``, and ``new`` rounded to its dtype, as the pair a cache write indexes: a float8 cache's values clamped
    to its largest (torch rounds a larger one to NaN; our Triton kernel's stores saturate the same way), both seen as
    bytes, which every indexed write takes (the CPU has no float8 ``index_copy_``)."""
    if kv.dtype.itemsize != 1:
        return kv, new.to(kv.dtype)
    largest = torch.finfo(kv.dtype).max
    return kv.view(torch.uint8), new.clamp(-largest, largest).to(kv.dtype).view(torch.uint8)


class KVCache(nn.Module):
    """Keys and values in one buffer [2, B, H_kv, S, D], so that a step writes both with one scatter
    (``index_copy_``) instead of two. The buffer's dtype may be narrower than the model's (a float32 model's float16
    cache, a float8 one): keys and values are rounded to it as they are written (:func:`stored`) and read back in
    the model's dtype."""

    paged = False
    blocks = None  # a paged cache's block table (PagedKVCache.blocks)

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        max_seq_length: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        shape = (2, batch_size, n_kv_heads, max_seq_length, head_dim)
        self.register_buffer("kv", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_row: int = 0, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` [B, H_kv, T, D] into the cache rows ``first_row`` to ``first_row + B - 1`` at positions
        ``input_pos``: [T], the same for every row, or [B, T], each row's own. Return those rows' keys and values,
        each [B, H_kv, S, D], or their first ``length`` positions [B, H_kv, length, D]."""
        batch = k.shape[0]
        kv, new = stored(self.kv, torch.stack((k, v)))  # [2, B, H_kv, T, D]
        if input_pos.dim() == 1 and batch == self.kv.shape[1]:  # every row of the cache at the same positions
            kv.index_copy_(3, input_pos, new)
        else:
            # Indexing the whole buffer, not a view of some rows, so that the compiled step writes only the new
            # entries in place (through a view, inductor copies the rows out and back).
            rows = torch.arange(first_row, first_row + batch, device=k.device)[:, None]  # [B, 1]
            positions = input_pos if input_pos.dim() == 2 else input_pos[None]  # [B, T] or [1, T]
            kv[:, rows, :, positions] = new.permute(1, 3, 0, 2, 4)  # [B, T, 2, H_kv, D]: indexed dims first
        kept = self.kv[:, first_row : first_row + batch, :, :length].to(k.dtype)  # [2, B, H_kv, length or S, D]
        return kept[0], kept[1]


class BlockTable(nn.Module):
    """Which cache block holds each run of ``block_size`` positions of each row: ``blocks`` [B, ceil(S / block_size)].
    Block 0 is the sink: a row's positions without a block of their own are read from and written to it, so that a
    row with no sequence (or a sequence's positions past its end) decodes harmlessly; nothing valid is ever in it."""

    def __init__(self, batch_size: int, max_seq_length: int, block_size: int, *, device: torch.device | str) -> None:
        super().__init__()
        width = -(-max_seq_length // block_size)
        self.register_buffer(
            "blocks", torch.zeros((batch_size, width), dtype=torch.long, device=device), persistent=False
        )
        self.block_size = block_size
        self.max_seq_length = max_seq_length


class PagedKVCache(nn.Module):
    """Keys and values in blocks, one buffer [2, N, block_size, H_kv, D] for ``N`` blocks shared by every row; the
    :class:`BlockTable` (one for all layers) maps a row's positions to blocks. :meth:`update` reads and writes as
    :meth:`KVCache.update` does (in a dtype of its own too), so that attention sees each row's keys in position
    order [B, H_kv, S, D]: a view of the gathered blocks, positions before heads, so that a compiled step reads the
    blocks inside the attention's reductions instead of copying them out first.

    ``heads_major``: in memory each block holds one kv head's positions after another ([2, N, H_kv, block_size, D]),
    ``kv`` the same [2, N, block_size, H_kv, D] view of it. Our C++ attention reads a head's block as one run then,
    where positions first interleave the heads (docs/cpu.md, "A narrower KV cache")."""

    paged = True

    def __init__(
        self,
        blocks: int,
        table: BlockTable,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        heads_major: bool = False,
    ) -> None:
        super().__init__()
        if heads_major:
            stored = torch.zeros((2, blocks, n_kv_heads, table.block_size, head_dim), dtype=dtype, device=device)
            kv = stored.transpose(2, 3)  # [2, N, block_size, H_kv, D]
        else:
            kv = torch.zeros((2, blocks, table.block_size, n_kv_heads, head_dim), dtype=dtype, device=device)
        self.register_buffer("kv", kv, persistent=False)
        self.table = [table]  # in a list: the table is the model's module, not a child of every layer's cache

    @property
    def blocks(self) -> torch.Tensor:
        """The block table's blocks [B, W] (:class:`BlockTable`), which the decode kernel reads."""
        return self.table[0].blocks

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_row: int = 0, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` [B, H_kv, T, D] at positions ``input_pos`` ([T] or [B, T]) of the rows ``first_row``
        onwards, into the blocks their table rows name; return those rows' keys and values [B, H_kv, S, D], or
        their first ``length`` positions [B, H_kv, length, D] (gathered from the blocks that hold them alone)."""
        table = self.table[0]
        batch, size = k.shape[0], table.block_size
        rows = table.blocks[first_row : first_row + batch]  # [B, W]
        positions = input_pos if input_pos.dim() == 2 else input_pos[None].expand(batch, -1)  # [B, T]
        block = rows.gather(1, positions // size)  # [B, T]
        kv, new = stored(self.kv, torch.stack((k, v)).transpose(2, 3))  # [2, B, T, H_kv, D]
        kv[:, block, positions % size] = new
        length = table.max_seq_length if length is None else length
        held = rows[:, : -(-length // size)]  # [B, blocks holding the first `length` positions]
        kv = self.kv[:, held].flatten(2, 3)[:, :, :length].transpose(2, 3).to(k.dtype)  # [2, B, H_kv, length, D]
        return kv[0], kv[1]


class DecodeState(nn.Module):
    """The token sequence and the current position, which the decode step reads and updates in place.

    As buffers with fixed addresses they are part of the captured CUDA graph, so a decode step is one graph
    launch with no kernels around it: it reads the token at ``input_pos``, writes the next one after it and
    advances ``input_pos``.
    """

    def __init__(self, batch_size: int, max_seq_length: int, *, device: torch.device | str) -> None:
        super().__init__()
        self.register_buffer(
            "tokens", torch.zeros((batch_size, max_seq_length), dtype=torch.long, device=device), persistent=False
        )
        self.register_buffer("input_pos", torch.zeros(1, dtype=torch.long, device=device), persistent=False)
