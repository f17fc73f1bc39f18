"""Static key/value cache: preallocated once per (batch, max length), updated in place.

Fixed buffer shapes keep the decode step's shapes fixed, so it compiles once with ``fullgraph=True`` and can be
captured as a CUDA graph (buffers are module state with stable addresses).
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    def __init__(self, batch_size: int, n_kv_heads: int, max_seq_length: int, head_dim: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        shape = (batch_size, n_kv_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``, ``v`` [B, H_kv, T, D] at positions ``input_pos`` [T]; return the whole cache [B, H_kv, S, D]."""
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache


class DecodeState(nn.Module):
    """The token sequence and the current position, which the decode step reads and updates in place.

    As buffers with fixed addresses they are part of the captured CUDA graph, so a decode step is one graph
    launch with no kernels around it: it reads the token at ``input_pos``, writes the next one after it and
    advances ``input_pos``.
    """

    def __init__(self, batch_size: int, max_seq_length: int, *, device: torch.device | str) -> None:
        super().__init__()
        self.register_buffer("tokens", torch.zeros((batch_size, max_seq_length), dtype=torch.long, device=device), persistent=False)
        self.register_buffer("input_pos", torch.zeros(1, dtype=torch.long, device=device), persistent=False)
