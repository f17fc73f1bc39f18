"""Generation on the device: the decode loop, step construction and compilation, sampling, speculation."""
