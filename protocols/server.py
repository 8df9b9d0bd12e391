"""`tokenloom serve`: the WebSocket token-streaming server (protocol in messages.py).

One engine, many connections, many requests per connection. Reliability rules: a
disconnect aborts every request of that connection (their KV blocks come back within
one engine step); a client that stops reading gets its deltas coalesced, and after
``send_timeout_s`` of a blocked send its requests are aborted and the transport is cut;
past ``max_queue`` unfinished requests a ``generate`` gets ``overloaded``; SIGTERM stops
accepting, lets running requests finish until a deadline, ends the rest as ``aborted``
and closes every connection with 1001.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import itertools
import json
from dataclasses import dataclass

import structlog
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Response

from tokenloom.core.errors import ClientError
from tokenloom.core.outputs import Finished
from tokenloom.protocols.messages import (
    PROTOCOL_VERSION,
    Accepted,
    Cancel,
    Done,
    Error,
    Generate,
    Limits,
    LogprobOut,
    MetricsOut,
    Ping,
    Pong,
    Session,
    decode_client,
    encode,
)
from tokenloom.protocols.metrics import ServerMetrics
from tokenloom.protocols.outbound import OutboundQueue

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
        if path == "/health":
            body = {"status": "draining" if self.draining else "ok", **self.engine.stats()}
            return _response(200, json.dumps(body), "application/json")
        if path == "/metrics":
            return _response(200, self.metrics.render(), self.metrics.content_type)
        if "upgrade" not in request.headers.get("Connection", "").lower():
            return _response(404, "not found: use /health, /metrics or a WebSocket upgrade\n")
        if self.options.api_key is not None:
            auth = request.headers.get("Authorization", "")
            given = auth[7:] if auth.startswith("Bearer ") else ""
            if not hmac.compare_digest(given.encode(), self.options.api_key.encode()):
                log.warning("auth_refused", peer=str(connection.remote_address[0]))
                return _response(401, "missing or invalid API key\n")
        if self.draining:
            return _response(503, "server is shutting down\n")
        if len(self.connections) >= self.options.max_connections:
            return _response(503, "too many connections\n")
        return None

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


def _response(status: int, body: str, content_type: str = "text/plain; charset=utf-8") -> Response:
    data = body.encode()
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(data))),
                       ("Connection", "close")])
    return Response(status, http.HTTPStatus(status).phrase, headers, data)


class Connection:
    def __init__(self, server: TokenServer, ws: ServerConnection, conn_id: int):
        self.server, self.ws, self.conn_id = server, ws, conn_id
        self.engine = server.engine
        self.out = OutboundQueue()
        self.tasks: dict[str, asyncio.Task] = {}  # client id -> streaming task
        self.cancelled: set[str] = set()
        self.log = log.bind(conn=conn_id)

    def _engine_id(self, rid: str) -> str:
        return f"c{self.conn_id}:{rid}"

    async def run(self) -> None:
        e, o = self.engine, self.server.options
        self.out.put(Session(protocol=PROTOCOL_VERSION, model=e.model_name,
                             limits=Limits(max_model_len=e.max_model_len, max_frame_bytes=o.max_frame_bytes,
                                           max_queue=o.max_queue, max_tokens_default=256),
                             strategies=e.config.to_dict()))
        writer = asyncio.create_task(self._writer())
        try:
            async for frame in self.ws:
                self._on_frame(frame)
        except ConnectionClosed:
            pass
        finally:
            self.abort_all()  # a disconnect aborts every request of this connection
            self.out.close()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            writer.cancel()

    def _on_frame(self, frame: str | bytes) -> None:
        if isinstance(frame, bytes):
            self.out.put(Error(code="binary_not_supported", message="send JSON text frames"))
            return
        msg = decode_client(frame)
        if isinstance(msg, Error):
            self.out.put(msg)
        elif isinstance(msg, Ping):
            self.out.put(Pong(data=msg.data))
        elif isinstance(msg, Cancel):
            self._cancel(msg.id)
        elif isinstance(msg, Generate):
            self._generate(msg)

    def _generate(self, msg: Generate) -> None:
        o, rid = self.server.options, msg.id
        if self.server.draining:
            self.out.put(Error(code="shutting_down", id=rid, message="the server is shutting down"))
            return
        if rid in self.tasks:
            self.out.put(Error(code="duplicate_id", id=rid, param="id", message=f"request {rid!r} is already running"))
            return
        if len(self.tasks) >= o.max_requests_per_connection:
            self.out.put(Error(code="too_many_requests", id=rid, message="too many requests on this connection"))
            return
        if self.engine.num_unfinished >= o.max_queue:
            self.server.metrics.overloaded.inc()
            self.out.put(Error(code="overloaded", id=rid, retry_after_ms=o.retry_after_ms,
                               message=f"{self.engine.num_unfinished} requests queued; retry later"))
            return
        try:
            prompt = msg.prompt if msg.prompt is not None else msg.prompt_token_ids
            messages = [{"role": m.role, "content": m.content} for m in msg.messages] if msg.messages else None
            req = self.engine.submit(prompt, msg.params, messages=messages, request_id=self._engine_id(rid),
                                     cache_salt=msg.cache_salt)
        except ClientError as exc:
            self.out.put(Error(code=exc.code, id=rid, param=exc.param, message=str(exc)))
            return
        self.out.put(Accepted(id=rid))
        self.tasks[rid] = asyncio.create_task(self._stream(rid, req))

    async def _stream(self, rid: str, req) -> None:
        try:
            async for item in self.engine.stream(req):
                if isinstance(item, Finished):
                    self._done(rid, item)
                else:
                    lps = None
                    if item.logprobs:
                        lps = [LogprobOut(token_id=lp.token_id, logprob=lp.logprob,
                                          top=[(t.token_id, t.logprob) for t in lp.top]) for lp in item.logprobs]
                    self.out.put_delta(rid, item.text, item.token_ids, lps)
        finally:
            self.tasks.pop(rid, None)
            self.cancelled.discard(rid)

    def _done(self, rid: str, f: Finished) -> None:
        reason = "cancelled" if f.finish_reason == "aborted" and rid in self.cancelled else f.finish_reason
        self.server.metrics.observe_finished(reason, f)
        m = f.metrics
        self.out.put(Done(id=rid, finish_reason=reason, usage=f.usage,
                          metrics=MetricsOut(ttft_ms=m.ttft_ms, tpot_ms=m.tpot_ms, e2e_ms=m.e2e_ms),
                          error=f.error))

    def _cancel(self, rid: str) -> None:
        if rid not in self.tasks:
            self.out.put(Error(code="unknown_id", id=rid, param="id", message=f"no running request {rid!r}"))
            return
        self.cancelled.add(rid)
        self.engine.abort(self._engine_id(rid))

    def abort_all(self) -> None:
        for rid in list(self.tasks):
            self.engine.abort(self._engine_id(rid))

    async def _writer(self) -> None:
        timeout = self.server.options.send_timeout_s
        while True:
            msg = await self.out.get()
            if msg is None:
                return
            try:
                await asyncio.wait_for(self.ws.send(encode(msg)), timeout)
            except TimeoutError:
                self.log.warning("send_timeout", seconds=timeout, pending=len(self.out))
                self.abort_all()
                self.out.close()
                self.ws.transport.abort()  # cut: the peer is not reading
                return
            except ConnectionClosed:
                return

    async def drain_and_close(self, code: int, reason: str) -> None:
        """Send what is queued (the final `done`s), then close."""
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        loop = asyncio.get_running_loop()
        end = loop.time() + self.server.options.send_timeout_s
        while len(self.out) and loop.time() < end and not self.out.closed:
            await asyncio.sleep(0.01)
        await self.ws.close(code, reason)
