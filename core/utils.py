"""Small arithmetic helpers that core, the plugins and the planner share."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``), without floats: the blocks ``a`` tokens take."""
    return -(-a // b)
