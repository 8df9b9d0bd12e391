"""Triton kernels, each beside its launcher and a plain-torch reference
(docs/architecture.md describes the layout).

None has landed yet: the `triton` backend is a later issue. This package exists so the
layout the design fixes is importable as ``tokenloom.kernels``.
"""
