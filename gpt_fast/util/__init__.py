"""Shared helpers that know nothing of models: devices and dtypes, files, paths, global torch settings, the hub."""
