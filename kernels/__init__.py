"""Kernels, each beside its loader and checked against a plain-torch reference.

- ``cpu_ops``: C++ decode attention for CPUs that reads KV blocks where they
  lie (and a layer-level op that also applies RoPE and writes the new K/V), built on first
  use with torch's inline extension loader; the torch backend uses it by default
  (``backend.decode_attention``) and keeps its own ops where it cannot be built.

Triton kernels for the `triton` backend are a later issue.
"""
