"""The pointer table that the persistent layers kernel (:mod:`gpt_fast.kernels.triton_persistent`) reads, kept free of
Triton so that the code that fills it imports without it."""

TABLE_COLUMNS = 7  # per layer: wqkv, wo, w13, w2, attention norm, MLP norm, kv cache
