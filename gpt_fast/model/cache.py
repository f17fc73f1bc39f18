"""Static key/value cache: preallocated once per (batch, max length), updated in place.

Fixed buffer shapes keep the decode step's shapes fixed, so it compiles once with ``fullgraph=True`` and can be
captured as a CUDA graph (buffers are module state with stable addresses).
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values in one buffer [2, B, H_kv, S, D], so that a step writes both with one scatter
    (``index_copy_``) instead of two."""

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
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_row: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` [B, H_kv, T, D] into the cache rows ``first_row`` to ``first_row + B - 1`` at positions
        ``input_pos``: [T], the same for every row, or [B, T], each row's own. Return those rows' keys and values,
        each [B, H_kv, S, D]."""
        batch = k.shape[0]
        new = torch.stack((k, v))  # [2, B, H_kv, T, D]
        if input_pos.dim() == 1 and batch == self.kv.shape[1]:  # every row of the cache at the same positions
            self.kv.index_copy_(3, input_pos, new)
        else:
            # Indexing the whole buffer, not a view of some rows, so that the compiled step writes only the new
            # entries in place (through a view, inductor copies the rows out and back).
            rows = torch.arange(first_row, first_row + batch, device=k.device)[:, None]  # [B, 1]
            positions = input_pos if input_pos.dim() == 2 else input_pos[None]  # [B, T] or [1, T]
            self.kv[:, rows, :, positions] = new.permute(1, 3, 0, 2, 4)  # [B, T, 2, H_kv, D]: indexed dims first
        return self.kv[0, first_row : first_row + batch], self.kv[1, first_row : first_row + batch]


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
