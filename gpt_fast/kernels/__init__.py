"""Every Triton kernel, as plain tensor functions; imports nothing of gpt-fast outside this package."""
