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

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` [B, H_kv, T, D] at positions ``input_pos`` [T]; return the whole cache's keys and
        values, each [B, H_kv, S, D]."""
        self.kv.index_copy_(3, input_pos, torch.stack((k, v)))
        return self.kv[0], self.kv[1]


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
