"""`tokenloom serve`: the WebSocket token-streaming server (protocol in messages.py).

One engine, many connections, many requests per connection. Reliability rules: a
disconnect aborts every request of that connection (their KV blocks come back within
one engine step); a client that stops reading gets its deltas coalesced, and after
``send_timeout_s`` of a blocked send its requests are aborted and the transport is cut;
a client that holds more than ``max_pending_bytes`` of unsent output is cut the same way;
past ``max_queue`` unfinished requests a ``generate`` gets ``overloaded``, past its
connection's rate limit ``rate_limited``, and while the engine restarts after a failed
step (or has given up) ``engine_unavailable``; prompts are tokenised off the event loop,
and any frame that cannot be handled gets an ``error`` while the connection and its other
requests carry on. With an API key set, the WebSocket and ``/metrics`` need it, and
``/health`` without it answers only its status. SIGTERM stops
accepting, lets running requests finish until a deadline, ends the rest as ``aborted``
and closes every connection with 1001.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import itertools
import json
import resource
from dataclasses import dataclass, field

import structlog
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Response

from tokenloom.protocols.connection import Connection
from tokenloom.protocols.metrics import ServerMetrics
from tokenloom.protocols.ratelimit import RateLimits

log = structlog.get_logger("tokenloom.server")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8765
    api_key: str | None = None
    allowed_origins: list[str] | None = None  # browser Origins; clients without one pass
    max_connections: int = 64
    max_queue: int = 256  # unfinished requests in the engine before `overloaded`
    max_requests_per_connection: int = 256
    max_frame_bytes: int = 1 << 20
    send_timeout_s: float = 10.0
    max_pending_bytes: int = 8 << 20  # unsent output a connection may hold before it is cut
    default_timeout_s: float | None = None  # a request's deadline when it sets no timeout_s
    rate_limits: RateLimits = field(default_factory=RateLimits)  # per connection
    public_metrics: bool = False  # serve /metrics without the API key (for a scraper)
    shutdown_deadline_s: float = 30.0
    retry_after_ms: int = 1000
    write_limit_bytes: int = 1 << 16  # websockets' write-buffer high-water mark
    socket_send_buffer: int | None = None  # SO_SNDBUF for accepted sockets (tests shrink it)


class TokenServer:
    def __init__(self, engine, options: ServerOptions | None = None):
        self.engine = engine
        self.options = options or ServerOptions()
        self.metrics = ServerMetrics(engine)
        self.connections: set[Connection] = set()
        self.draining = False
        self.num_admitting = 0  # generate requests being tokenised (count towards max_queue)
        self._server = None
        self._conn_ids = itertools.count(1)

    @property
    def port(self) -> int:
        return next(iter(self._server.sockets)).getsockname()[1]

    async def start(self) -> None:
        o = self.options
        if o.host not in LOOPBACK and not o.api_key:
            log.warning("binding_without_api_key", host=o.host,
                        hint="anyone who can reach this address can use the model; set TOKENLOOM_API_KEY")
        origins = [*o.allowed_origins, None] if o.allowed_origins else None
        self._server = await serve(self._handle, o.host, o.port, max_size=o.max_frame_bytes, origins=origins,
                                   process_request=self._process_request, server_header=None,
                                   write_limit=o.write_limit_bytes)
        log.info("server_started", host=o.host, port=self.port, model=self.engine.model_name)

    # ---- HTTP side of the port: health, metrics, auth, connection limit ---------------
    def _process_request(self, connection: ServerConnection, request) -> Response | None:
        path = request.path.split("?", 1)[0]
        authorized = self._authorized(request)
        if path == "/health":
            return self._health(full=authorized)
        if path == "/metrics":
            if not (authorized or self.options.public_metrics):
                return _response(401, "missing or invalid API key\n")
            return _response(200, self.metrics.render(), self.metrics.content_type)
        if "upgrade" not in request.headers.get("Connection", "").lower():
            return _response(404, "not found: use /health, /metrics or a WebSocket upgrade\n")
        if not authorized:
            log.warning("auth_refused", peer=str(connection.remote_address[0]))
            return _response(401, "missing or invalid API key\n")
        if self.draining:
            return _response(503, "server is shutting down\n")
        if len(self.connections) >= self.options.max_connections:
            return _response(503, "too many connections\n")
        return None

    def _authorized(self, request) -> bool:
        if self.options.api_key is None:
            return True
        auth = request.headers.get("Authorization", "")
        given = auth[7:] if auth.startswith("Bearer ") else ""
        return hmac.compare_digest(given.encode(), self.options.api_key.encode())

    def _health(self, *, full: bool) -> Response:
        """200 while the engine can serve, 503 (with the reason) while draining, restarting
        after a failed step, or dead. Without the API key: the status alone."""
        report = self.engine.health_report()
        status = "draining" if self.draining else report.status
        body: dict = {"status": status}
        if report.retry_after_ms is not None and not self.draining:
            body["retry_after_ms"] = report.retry_after_ms
        if full:
            if status != "ok":
                body["reason"] = "the server is shutting down" if self.draining else report.reason
            body.update(engine_failures=report.engine_failures, **self.engine.stats(), **process_memory())
        return _response(200 if status == "ok" else 503, json.dumps(body), "application/json")

    async def _handle(self, ws: ServerConnection) -> None:
        if self.options.socket_send_buffer:
            import socket

            sock = ws.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.options.socket_send_buffer)
        conn = Connection(self, ws, next(self._conn_ids))
        self.connections.add(conn)
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)

    # ---- shutdown -----------------------------------------------------------------------
    async def shutdown(self, deadline_s: float | None = None) -> None:
        """Stop accepting; let running requests finish until the deadline; abort the rest;
        close every connection with 1001."""
        deadline_s = self.options.shutdown_deadline_s if deadline_s is None else deadline_s
        self.draining = True
        if self._server is not None:
            self._server.close(close_connections=False)
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while self.engine.num_unfinished and loop.time() < end:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.abort_all()
        for conn in list(self.connections):
            await conn.drain_and_close(1001, "server shutting down")
        if self._server is not None:
            await self._server.wait_closed()
        log.info("server_stopped")


def process_memory() -> dict[str, int]:
    """This process's resident memory now and at its peak, in bytes (Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        rss = peak
    return {"rss_bytes": rss, "peak_rss_bytes": peak}


def _response(status: int, body: str, content_type: str = "text/plain; charset=utf-8") -> Response:
    data = body.encode()
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(data))),
                       ("Connection", "close")])
    return Response(status, http.HTTPStatus(status).phrase, headers, data)
