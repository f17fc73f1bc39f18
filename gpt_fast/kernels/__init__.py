"""Hand-written kernels the model can be given in place of its PyTorch code (the model does not import them)."""
