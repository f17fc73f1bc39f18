"""Turning Hugging Face folders, GGUF files and random initialisations into gpt-fast checkpoints."""
