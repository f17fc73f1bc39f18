"""Tensor parallelism over the GPUs of one host: ranks, shards, collectives, and starting the ranks."""
