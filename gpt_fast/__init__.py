"""gpt-fast: fast single-GPU LLM text generation in native PyTorch."""

__version__ = "0.1.0"
