"""The decoder, its KV cache and its frozen configuration; it knows nothing of kernels, quantization or parallelism."""
