"""The engine: a checkpoint ready to generate, its options, and the batcher; the one boundary commands use."""
