"""Kernels, each beside its loader and checked against a plain-torch reference.

- ``cpu_ops``: C++ decode attention for CPUs that reads KV blocks where they
  lie (and a layer-level op that also applies RoPE and writes the new K/V), built on first
  use from its C++ in ``kernels/csrc/`` with torch's extension loader; the torch backend uses it by default
  (``backend.decode_attention``) and keeps its own ops where it cannot be built.

- ``triton``: the `triton` backend's kernels (paged attention, KV write, norms, RoPE,
  4-bit and fp8 matmuls), each with its launcher and torch reference; importing it
  defines them, so without a GPU set ``TRITON_INTERPRET=1`` first.
"""
