"""Small helpers that core, the plugins and the planner share."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``), without floats: the blocks ``a`` tokens take."""
    return -(-a // b)


def resident_bytes() -> int:
    """This process's resident memory now, in bytes (Linux ``/proc/self/statm``; 0 elsewhere)."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return 0
