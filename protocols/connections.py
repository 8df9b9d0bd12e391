"""Open connections, counted and capped across every frontend of one `tokenloom serve`.

Every TCP connection a frontend accepts (a WebSocket, a plain HTTP request on the
WebSocket port, an OpenAI HTTP connection) counts towards one total, ``max_connections``,
and towards its client address's share, ``max_connections_per_client`` (0: no per-address
cap). A connection over either cap is answered ``503 too many connections`` with
``Connection: close`` and closed (after at most ``REFUSAL_LINGER_S``, so that a client
still sending its request reads the answer instead of a reset); refusals are counted in
``tokenloom_connections_refused_total{frontend, reason}`` and logged at most once per
``LOG_EVERY_S``, never once each.

A process out of file descriptors cannot accept at all: asyncio's accept loop then
reports each failed ``accept()`` to the loop's exception handler, which by default logs a
traceback each (hundreds of thousands in seconds under a flood). :func:`install_accept_guard`
counts them instead (``tokenloom_accept_errors_total{errno}``, a warning at most once per
``LOG_EVERY_S``) while asyncio backs off (it stops accepting for a second). :func:`fit_fd_limit`
makes that the exception: it raises the soft open-file limit to what the caps need, or
lowers the cap to what the limit allows.
"""

from __future__ import annotations

import asyncio
import errno
import resource
import time
from collections import Counter

import structlog

log = structlog.get_logger("tokenloom.server")

REFUSAL_LINGER_S = 1.0  # a refused connection stays half-open this long at most
MAX_LINGERING = 128  # refused connections held at once; past this they are closed at once
FD_RESERVE = 256  # descriptors kept for everything but connections (model files, threads, logs)
LOG_EVERY_S = 10.0
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: 21\r\nRetry-After: 1\r\nConnection: close\r\n\r\ntoo many connections\n")


class ConnectionLimits:
    """The count of open connections, in total and per client address, shared by every
    frontend of a :class:`~tokenloom.protocols.gateway.Gateway`."""

    def __init__(self, max_total: int, max_per_client: int = 0, metrics=None):
        self.max_total, self.max_per_client, self.metrics = max_total, max_per_client, metrics
        self.total = 0
        self.per_client: Counter[str] = Counter()
        self.lingering = 0
        self._unlogged: Counter[tuple[str, str]] = Counter()
        self._logged_at = float("-inf")
        self._flush: asyncio.TimerHandle | None = None

    def open(self, frontend: str, client: str) -> str | None:
        """Count a new connection from ``client``; or, over a cap, the reason it is refused
        (``total`` or ``per_client``), counted."""
        if self.total >= self.max_total:
            reason = "total"
        elif self.max_per_client and self.per_client[client] >= self.max_per_client:
            reason = "per_client"
        else:
            self.total += 1
            self.per_client[client] += 1
            if self.metrics is not None:
                self.metrics.connections_open.labels(frontend=frontend).inc()
            return None
        if self.metrics is not None:
            self.metrics.connections_refused.labels(frontend=frontend, reason=reason).inc()
        self._unlogged[(frontend, reason)] += 1
        wait = self._logged_at + LOG_EVERY_S - time.monotonic()
        if wait <= 0:
            self._log_refusals()
        elif self._flush is None:  # the rest of this burst: one line when the interval is over
            self._flush = asyncio.get_running_loop().call_later(wait, self._log_refusals)
        return reason

    def _log_refusals(self) -> None:
        self._flush = None
        self._logged_at = time.monotonic()
        refused = {f"{f}/{r}": n for (f, r), n in self._unlogged.items()}
        self._unlogged.clear()
        log.warning("connections_refused", refused=refused, open=self.total, max_connections=self.max_total,
                    max_connections_per_client=self.max_per_client)

    def close(self, frontend: str, client: str) -> None:
        self.total -= 1
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]
        if self.metrics is not None:
            self.metrics.connections_open.labels(frontend=frontend).dec()

    def refuse(self, transport: asyncio.Transport) -> asyncio.TimerHandle | None:
        """Answer 503 and close: write, half-close, and close for good once the client has
        read it and closed its side, or after ``REFUSAL_LINGER_S`` (at once when
        ``MAX_LINGERING`` refused connections are already waiting). Returns the timer to
        cancel when the connection is gone (see :meth:`refused_lost`), or None."""
        transport.write(_REFUSAL)
        if self.lingering >= MAX_LINGERING or not transport.can_write_eof():
            transport.close()
            return None
        self.lingering += 1
        transport.write_eof()
        return asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.abort)

    def refused_lost(self, timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()
            self.lingering -= 1


def client_of(transport: asyncio.BaseTransport) -> str:
    """The client's address (host only: one client, many ports)."""
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"


class CountedProtocol(asyncio.Protocol):
    """Mixin for an asyncio protocol class (``class P(CountedProtocol, Base)``): its
    connection is counted in ``limits`` while it is open, and refused over a cap (the base
    protocol then never sees it). The subclass sets ``limits`` and ``frontend``."""

    limits: ConnectionLimits
    frontend: str
    _client: str | None = None
    _refused = False
    _refusal_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        client = client_of(transport)
        if self.limits.open(self.frontend, client) is not None:
            self._refused = True
            self._refusal_timer = self.limits.refuse(transport)
            return
        self._client = client
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def eof_received(self):
        if self._refused:
            return None  # close
        return super().eof_received()

    def connection_lost(self, exc) -> None:
        if self._refused:
            self.limits.refused_lost(self._refusal_timer)
            self._refusal_timer = None
            return
        if self._client is not None:
            self.limits.close(self.frontend, self._client)
            self._client = None
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        if not self._refused:
            super().pause_writing()

    def resume_writing(self) -> None:
        if not self._refused:
            super().resume_writing()


def counted(base: type, limits: ConnectionLimits, frontend: str, **attrs) -> type:
    """``base`` (an asyncio protocol class) with its connections counted in ``limits``."""
    return type(f"Counted{base.__name__}", (CountedProtocol, base), {"limits": limits, "frontend": frontend, **attrs})


# ---- out of file descriptors ------------------------------------------------------------
def install_accept_guard(loop: asyncio.AbstractEventLoop, metrics=None) -> None:
    """Count failed accepts for want of descriptors or memory instead of logging a traceback
    each; everything else goes to the handler that was there. Idempotent."""
    previous = loop.get_exception_handler()
    if getattr(previous, "tokenloom_accept_guard", False):
        return
    state = {"unlogged": 0, "logged_at": 0.0}

    def handler(loop, context):
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS and "accept" in context.get("message", ""):
            if metrics is not None:
                metrics.accept_errors.labels(errno=errno.errorcode.get(exc.errno, str(exc.errno))).inc()
            state["unlogged"] += 1
            now = time.monotonic()
            if now - state["logged_at"] >= LOG_EVERY_S:
                state["logged_at"] = now
                log.warning("accept_failed", error=errno.errorcode.get(exc.errno, str(exc.errno)),
                            count=state["unlogged"], open_file_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                            hint="out of file descriptors: lower --max-connections or raise `ulimit -n`")
                state["unlogged"] = 0
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.tokenloom_accept_guard = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)


def fit_fd_limit(max_connections: int) -> int:
    """Raise this process's soft open-file limit (up to the hard one) to hold
    ``max_connections`` plus refusals in progress plus ``FD_RESERVE``; where the hard limit
    is lower, return the connection cap that fits it (logged), else ``max_connections``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + MAX_LINGERING + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        fitted = max(1, soft - MAX_LINGERING - FD_RESERVE)
        log.warning("max_connections_lowered", asked=max_connections, to=fitted, open_file_limit=soft,
                    hint="raise the hard limit (ulimit -Hn, LimitNOFILE=) to serve more")
        return fitted
    return max_connections
