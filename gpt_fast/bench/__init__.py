"""Benchmarks: compile modes, decode against peers, the server under load, speculation, tensor parallelism."""
