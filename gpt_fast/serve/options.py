"""`gpt-fast serve`'s options, checked once as they are made. Imports no torch: the command line refuses a mistake
before it loads anything."""

from __future__ import annotations

from dataclasses import dataclass

from gpt_fast.engine.options import BatchOptions

# as BatchOptions'
CACHE_OPTIONS = ("block_size", "kv_cache_memory", "kv_cache_tokens", "kv_cache", "prefill_chunk", "step_sizes")
DEFAULT_CONTEXT = 2048  # tokens per slot unless --max_seq_length says otherwise (or the model's context is shorter)


@dataclass(frozen=True)
class ServeOptions:
    """`gpt-fast serve`'s options besides the checkpoint and the engine's."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 8
    max_seq_length: int | None = None  # None: the model's context, at most DEFAULT_CONTEXT
    max_queue: int = 64
    block_size: int = 16
    kv_cache_memory: float | None = None  # None: every slot can hold max_seq_length tokens
    kv_cache_tokens: int | None = None
    kv_cache: str = "paged"
    prefill_chunk: int | None = None
    step_sizes: tuple[int, ...] | None = None  # None: engine.options.STEP_SIZES below max_batch, and max_batch
    api_key: str | None = None
    model_name: str | None = None  # None: the checkpoint folder's name

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api_key is empty")
        if self.model_name is not None and not self.model_name.strip():
            raise ValueError("--model_name is empty")
        self.batch_options(None)

    def batch_options(self, block_size: int | None) -> BatchOptions:
        """The batcher's options for a model whose context is ``block_size`` tokens (None: only check them)."""
        if block_size is not None and self.max_seq_length is not None and self.max_seq_length > block_size:
            raise ValueError(f"--max_seq_length {self.max_seq_length} exceeds the model's context of {block_size}")
        length = self.max_seq_length
        if block_size is not None:
            length = length or min(block_size, DEFAULT_CONTEXT)
        cache = {name: getattr(self, name) for name in CACHE_OPTIONS}
        return BatchOptions(self.max_batch, length, self.max_queue, **cache)
