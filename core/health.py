"""What happens after a failed step: the engine's restart policy and the state it reports.

A step that raises ends every request in flight with ``finish_reason="error"`` (their KV
blocks come back), then the step loop restarts in-process after a back-off that doubles
with each failure in a row (``restart_backoff_s``, 2x, 4x, ... capped at
``max_backoff_s``). One successful step resets the count. After more than
``max_restarts`` failures in a row the engine is dead: it refuses every request and
``tokenloom serve`` drains and exits non-zero so that a supervisor restarts the process.
While it cannot serve, ``submit`` raises :class:`EngineUnavailable` (wire code
``engine_unavailable``, with ``retry_after_ms`` while a restart is pending).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.core.errors import EngineUnavailable


@dataclass(slots=True, frozen=True)
class HealthReport:
    status: str  # ok | restarting | dead
    reason: str | None = None
    retry_after_ms: int | None = None
    engine_failures: int = 0  # failed steps since start

    @property
    def can_serve(self) -> bool:
        return self.status == "ok"


class EngineHealth:
    def __init__(self, max_restarts: int = 5, backoff_s: float = 0.5, max_backoff_s: float = 30.0):
        self.max_restarts, self.backoff_s, self.max_backoff_s = max_restarts, backoff_s, max_backoff_s
        self.failures = 0  # since start
        self.consecutive = 0  # since the last successful step
        self.dead = False
        self.retry_at = 0.0  # monotonic time before which the loop stays down
        self.last_error: str | None = None

    def on_failure(self, exc: BaseException, now: float, fatal: bool = False) -> None:
        """A failed step; ``fatal``: one no restart can mend (a tensor-parallel rank is gone)."""
        self.failures += 1
        self.consecutive += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:200]
        if fatal or self.consecutive > self.max_restarts:
            self.dead = True
        else:
            self.retry_at = now + min(self.backoff_s * 2 ** (self.consecutive - 1), self.max_backoff_s)

    def on_success(self) -> None:
        self.consecutive = 0

    def report(self, now: float) -> HealthReport:
        if self.dead:
            why = (f"step failed {self.consecutive} times in a row; last: " if self.consecutive > self.max_restarts
                   else "step failed and cannot be retried: ")
            return HealthReport("dead", why + str(self.last_error), None, self.failures)
        if now < self.retry_at:
            return HealthReport("restarting", f"step failed: {self.last_error}",
                                max(1, round((self.retry_at - now) * 1e3)), self.failures)
        return HealthReport("ok", engine_failures=self.failures)

    def check(self, now: float) -> None:
        """Raise :class:`EngineUnavailable` unless the engine can take a request now."""
        r = self.report(now)
        if not r.can_serve:
            raise EngineUnavailable(f"the engine cannot serve ({r.status}): {r.reason}",
                                    retry_after_ms=r.retry_after_ms)
