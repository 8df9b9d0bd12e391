"""Compute backends: `torch` (the reference, CPU or GPU) and, later, `triton`."""
