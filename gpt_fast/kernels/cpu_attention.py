"""The attention of a decode step on an x86 CPU as one C++ operator, ``torch.ops.gpt_fast.decode_attention_cpu``
(``cpu_attention.cpp``, built into the library of :mod:`gpt_fast.kernels.cpu_gemv`): the rotary embedding of the
step's query and key, their write into the cache and the attention over the positions the query sees.

A compiled step of the model's own code (:func:`gpt_fast.model.transformer.attend_one_query`) reads every position of
the cache under a mask; this reads the query's positions only, each kv head's once for the query heads that share it.
"""

from __future__ import annotations

import torch

# the caches narrower than a float32 model's that the operator reads: keys and values widened to float32 as it loads
# them, rounded to the cache's dtype as it writes them (float8's clamped to its largest, as KVCache.update clamps)
NARROWER_CACHES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def decode_attention(*args: object) -> torch.Tensor:
    """The arguments and result of :func:`gpt_fast.kernels.triton_decode_attention.decode_attention` but ``launch``,
    ``wrap`` and ``pdl`` (``q`` [B, 1, H, D], ``k``, ``v`` [B, 1, H_kv, D], the static cache ``kv`` [2, R, H_kv, S, D]
    or the paged one with its block table last, written in place), on the CPU in float32, bfloat16 or float16 (a
    float32 model's cache may be one of :data:`NARROWER_CACHES`), D a multiple of 8. The caller loads the library
    first (:func:`gpt_fast.kernels.cpu_gemv.load_cpu_kernels`)."""
    return torch.ops.gpt_fast.decode_attention_cpu(*args)
