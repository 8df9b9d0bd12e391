"""Triton kernels, each beside its launcher and a plain-torch reference (DESIGN.md).

None has landed yet: the `triton` backend is a later issue. This package exists so the
layout the design fixes is importable as ``tokenloom.kernels``.
"""
