"""Reading a checkpoint safely into a model."""
