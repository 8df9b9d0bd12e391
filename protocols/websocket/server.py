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
and closes every connection with 1001. Connections count towards the gateway's limits,
shared with the OpenAI port (``max_connections`` in all, ``max_connections_per_client``
per address; over them a 503 and close, counted, see protocols/connections.py), and a
connection's handshake or plain request must arrive within ``http_header_timeout_s``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from importlib import resources

import structlog
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Response

from tokenloom.protocols.connections import counted, install_accept_guard
from tokenloom.protocols.gateway import Gateway, ServerOptions  # noqa: F401 (ServerOptions re-exported)
from tokenloom.protocols.http import (
    bytes_response,
    json_response,
    refuse_upgrade,
    select_subprotocol,
    text_response,
)
from tokenloom.protocols.metrics import health_body, process_memory  # noqa: F401 (process_memory re-exported)
from tokenloom.protocols.websocket.connection import Connection

log = structlog.get_logger("tokenloom.server")
# The playground: static files in the package, served as they are (no build step, no CDN).
STATIC_FILES = {"/": ("index.html", "text/html; charset=utf-8"),
                "/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
                "/playground.css": ("playground.css", "text/css; charset=utf-8")}


class TokenServer:
    """The ``websocket`` frontend: the token-streaming protocol, plus ``/health``,
    ``/metrics``, ``/stats`` and the playground page over plain HTTP on the same port."""

    name = "websocket"

    def __init__(self, engine, options: ServerOptions | None = None, gateway: Gateway | None = None):
        self.engine = engine
        self.gateway = gateway or Gateway(engine, options)
        self.options = options or self.gateway.options
        self.metrics = self.gateway.metrics
        self.connections: set[Connection] = set()
        self._server = None
        self._conn_ids = itertools.count(1)
        self._started_at = time.monotonic()

    @property
    def draining(self) -> bool:
        return self.gateway.draining

    @property
    def port(self) -> int:
        return next(iter(self._server.sockets)).getsockname()[1]

    def urls(self) -> list[str]:
        host = self.options.host
        host = f"[{host}]" if ":" in host else host
        return [f"ws://{host}:{self.port}", f"http://{host}:{self.port}/ (playground)"]

    async def start(self) -> None:
        o = self.options
        install_accept_guard(asyncio.get_running_loop(), self.metrics)
        # Every TCP connection counts in the gateway's limits (the OpenAI port's too) and is
        # refused over them; the handshake (or a plain request) must come within the header timeout.
        self._server = await serve(self._handle, o.host, o.port, max_size=o.max_frame_bytes,
                                   process_request=self._process_request, server_header=None,
                                   select_subprotocol=select_subprotocol,
                                   write_limit=o.write_limit_bytes, open_timeout=o.http_header_timeout_s,
                                   create_connection=counted(ServerConnection, self.gateway.connections,
                                                             "websocket"))
        log.info("server_started", host=o.host, port=self.port, model=self.engine.model_name)

    # ---- HTTP side of the port: health, metrics, auth, connection limit ---------------
    async def _process_request(self, connection: ServerConnection, request) -> Response | None:
        path = request.path.split("?", 1)[0]
        authorized = self.gateway.rules.request_authorized(request)
        if path in ("/health", "/metrics", "/stats") and (authorized or self.options.public_metrics):
            await self.engine.refresh_stats()  # the engine core's numbers, when it runs in its own process
        if path == "/health":
            return self._health(full=authorized)
        if path == "/favicon.ico":  # browsers ask; the playground declares none
            return text_response(204, "")
        if path in ("/metrics", "/stats"):
            if not (authorized or self.options.public_metrics):
                return text_response(401, "missing or invalid API key\n")
            if path == "/stats":
                return json_response(200, self.live_stats())
            return text_response(200, self.metrics.render(), self.metrics.content_type)
        if "upgrade" not in request.headers.get("Connection", "").lower():
            if path in STATIC_FILES:
                return _static(*STATIC_FILES[path])
            return text_response(404, "not found: use / (playground), /health, /metrics, /stats or a WebSocket upgrade\n")
        refused = refuse_upgrade(request, self.gateway.rules, authorized=authorized, draining=self.draining,
                                 num_connections=len(self.connections), max_connections=self.options.max_connections)
        if refused is not None and refused.status_code == 401:
            log.warning("auth_refused", peer=str(connection.remote_address[0]))
        return refused

    def live_stats(self) -> dict:
        """What the playground's engine panel polls: queues, KV blocks (with the per-block
        map: one digit per block, 0 free, 1 used, 2 cached), prefix hits, preemptions,
        speculative acceptance and the strategy combination. Read between steps' writes:
        a display, consistent to within a step."""
        e = self.engine
        stats = e.stats()
        return {"model": e.model_name, "uptime_s": round(time.monotonic() - self._started_at, 1),
                "health": "draining" if self.draining else e.health_report().status,
                "strategies": e.config.to_dict(), "stats": stats,
                "max_model_len": e.max_model_len, "block_size": e.config.engine.block_size, "blocks": e.kv_block_map(),
                "frontends": [f.name for f in e.config.frontends]}

    def _health(self, *, full: bool) -> Response:
        """200 while the engine can serve, 503 (with the reason) while draining, restarting
        after a failed step, or dead. Without the API key: the status alone."""
        return json_response(*health_body(self.engine, draining=self.draining, full=full))

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
    def stop_accepting(self) -> None:
        self.gateway.draining = True
        if self._server is not None:
            self._server.close(close_connections=False)

    async def close(self) -> None:
        """Abort what still runs (each request still gets its ``done``), then close every
        connection with 1001."""
        for conn in list(self.connections):
            conn.abort_all()
        for conn in list(self.connections):
            await conn.drain_and_close(1001, "server shutting down")
        if self._server is not None:
            await self._server.wait_closed()

    async def shutdown(self, deadline_s: float | None = None) -> None:
        """Stop accepting; let running requests finish until the deadline; abort the rest;
        close every connection with 1001. (Alone: `tokenloom serve` goes through
        :class:`tokenloom.protocols.gateway.FrontendHost`, which does this for every frontend.)"""
        deadline_s = self.options.shutdown_deadline_s if deadline_s is None else deadline_s
        self.stop_accepting()
        await self.gateway.wait_drained(deadline_s)
        await self.close()
        log.info("server_stopped")


def _static(filename: str, content_type: str) -> Response:
    data = resources.files("tokenloom.protocols.websocket").joinpath("static", filename).read_bytes()
    return bytes_response(200, data, content_type, [("Cache-Control", "no-cache"), ("X-Content-Type-Options", "nosniff")])
