"""Summary statistics for latency samples, with the conventions benchmark readers expect."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default, "linear"); ``q`` in [0, 100]."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan, "n": 0}
    return {"mean": sum(vals) / len(vals), "p50": percentile(vals, 50), "p90": percentile(vals, 90),
            "p99": percentile(vals, 99), "n": len(vals)}


def ratio(value: float, baseline: float) -> float:
    """value / baseline; nan when the baseline is zero or missing."""
    if baseline is None or value is None or baseline == 0 or math.isnan(baseline):
        return math.nan
    return value / baseline
