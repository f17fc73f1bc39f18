"""Fast paths: which kernel serves each operation on a device, and installing it into a built model."""
