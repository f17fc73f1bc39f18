"""Named model shapes, for random-weight checkpoints (benchmarks, tests). Matched exactly by name."""

from __future__ import annotations

from gpt_fast.config import ModelConfig

SHAPES: dict[str, ModelConfig] = {
    "llama-2-7b": ModelConfig(
        block_size=4096,
        vocab_size=32000,
        n_layer=32,
        n_head=32,
        dim=4096,
        intermediate_size=11008,
        n_local_heads=32,
        head_dim=128,
        rope_base=10000.0,
        norm_eps=1e-5,
    ),
    "llama-3-8b": ModelConfig(
        block_size=8192,
        vocab_size=128256,
        n_layer=32,
        n_head=32,
        dim=4096,
        intermediate_size=14336,
        n_local_heads=8,
        head_dim=128,
        rope_base=500000.0,
        norm_eps=1e-5,
    ),
    "smollm2-135m": ModelConfig(
        block_size=8192,
        vocab_size=49152,
        n_layer=30,
        n_head=9,
        dim=576,
        intermediate_size=1536,
        n_local_heads=3,
        head_dim=64,
        rope_base=100000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
    ),
    "tiny": ModelConfig(
        block_size=512,
        vocab_size=512,
        n_layer=2,
        n_head=4,
        dim=64,
        intermediate_size=160,
        n_local_heads=2,
        head_dim=16,
        rope_base=10000.0,
        norm_eps=1e-5,
    ),
}


def get_shape(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known shapes: {', '.join(SHAPES)}")
    return SHAPES[name]
