"""Per-connection rate limits: token buckets for requests and for tokens per minute.

A request is charged one request when it arrives and ``prompt tokens + max_tokens``
tokens once its prompt is tokenised (what it may cost, as OpenAI's limits count it).
A refusal is ``rate_limited`` with ``retry_after_ms`` — the time until the bucket holds
enough — distinct from ``overloaded``, which means the whole server is full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


class TokenBucket:
    """``capacity`` units, refilled continuously at ``capacity`` per ``period_s``."""

    def __init__(self, capacity: float, period_s: float = 60.0, clock=time.monotonic):
        self.capacity, self.rate, self.clock = float(capacity), capacity / period_s, clock
        self.level, self.stamp = float(capacity), clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_ms(self, amount: float) -> int:
        """0 if ``amount`` can be taken now, else the milliseconds until it can.
        An amount over the capacity can never be taken: it waits for a full bucket."""
        self._refill()
        missing = min(amount, self.capacity) - self.level
        return 0 if missing <= 0 else max(1, int(missing / self.rate * 1e3 + 0.999))

    def take(self, amount: float) -> int:
        """Take ``amount`` and return 0, or take nothing and return :meth:`wait_ms`."""
        wait = self.wait_ms(amount)
        if wait == 0:
            self.level -= min(amount, self.capacity)
        return wait


@dataclass(slots=True)
class RateLimits:
    requests_per_minute: int | None = None  # None: no limit
    tokens_per_minute: int | None = None


class RateLimiter:
    def __init__(self, limits: RateLimits, clock=time.monotonic):
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        self.requests = TokenBucket(rpm, clock=clock) if rpm else None
        self.tokens = TokenBucket(tpm, clock=clock) if tpm else None

    def take_request(self) -> int:
        return self.requests.take(1) if self.requests else 0

    def take_tokens(self, n: int) -> int:
        return self.tokens.take(n) if self.tokens else 0
