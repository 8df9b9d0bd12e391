"""`tokenloom router`: one WebSocket endpoint in front of N `tokenloom serve` replicas
(data parallelism), speaking the same protocol (messages.py) as a single server.

Routing is cache-aware, after SGLang's router (sgl-router, "cache-aware load balancing"):
a replica's prefix cache only helps requests that reach it, so requests sharing a prefix
(a system prompt, a conversation's earlier turns) should go where that prefix already is,
as long as that does not pile work onto one replica. The router keeps, per replica, an
approximate bounded prefix index (router_policy.py) of the canonical prompt text it sent
there: the prompt, the chat messages rendered role + content, or the token ids as
digits; and, once a request finishes, its prompt extended by the answer, as the next turn
of the conversation will start. A request goes to the replica with the longest matched
prefix when the match covers at least ``cache_threshold`` of its prompt and that replica
has at most ``balance_abs_threshold`` more requests in flight than the least loaded one;
otherwise to the least loaded replica (fewest in flight; ties in round-robin order).

Replicas that are down (the connection fails, or ``/health`` is not ok) are skipped and
polled until they answer again. A request in flight on a replica that dies ends at once:
``error`` (code ``engine_unavailable``) if the replica had not accepted it, else a final
``done`` with finish reason ``error`` naming the replica. Plain HTTP on the same port:
``/health`` (ok while a replica is up), ``/stats`` (JSON) and ``/metrics`` (Prometheus),
with the server's API-key and Origin rules (protocols/http.py); the key is also sent to
the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass

import structlog
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Response

from tokenloom.core.errors import ClientError
from tokenloom.protocols.http import (
    AccessRules,
    json_response,
    refuse_upgrade,
    select_subprotocol,
    text_response,
)
from tokenloom.protocols.router.client import ClientConnection
from tokenloom.protocols.router.policy import (
    Candidate,
    PrefixIndex,
    block_hashes,
    canonical_text,
    route,
)
from tokenloom.protocols.router.upstream import Pending, Replica, ReplicaDown
from tokenloom.protocols.websocket.messages import Error

log = structlog.get_logger("tokenloom.router")


@dataclass(slots=True)
class RouterOptions:
    host: str = "127.0.0.1"
    port: int = 8765
    api_key: str | None = None  # clients must present it; it is sent on to the replicas
    allowed_origins: tuple[str, ...] = ()  # browser Origins (the server's rule: protocols/http.py)
    cache_threshold: float = 0.5  # fraction of the prompt a replica's match must cover
    balance_abs_threshold: int = 32  # in-flight lead over the least loaded that overrides the cache
    health_interval_s: float = 1.0
    index_block_chars: int = 16
    index_max_chars: int = 1 << 22  # per replica
    max_connections: int = 256
    max_requests_per_connection: int = 256
    max_frame_bytes: int = 1 << 20
    send_timeout_s: float = 10.0
    shutdown_deadline_s: float = 30.0
    public_metrics: bool = False

    def validate(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ClientError.bad_value("cache_threshold", self.cache_threshold, "between 0 and 1")
        if self.balance_abs_threshold < 0:
            raise ClientError.bad_value("balance_abs_threshold", self.balance_abs_threshold, ">= 0")


class Router:
    def __init__(self, replica_urls: list[str], options: RouterOptions | None = None):
        self.options = o = options or RouterOptions()
        o.validate()
        self.rules = AccessRules(o.api_key, tuple(o.allowed_origins))
        urls = [u.rstrip("/") for u in replica_urls]
        if not urls:
            raise ClientError("give at least one --replica", param="replica")
        for u in urls:
            if not u.startswith(("ws://", "wss://")):
                raise ClientError.bad_value("replica", u, "a ws:// or wss:// URL")
        if len(set(urls)) != len(urls):
            raise ClientError("the same --replica is given twice", param="replica")
        self.replicas = [Replica(u, api_key=o.api_key, index=PrefixIndex(o.index_block_chars, o.index_max_chars))
                         for u in urls]
        self.clients: set[ClientConnection] = set()
        self.draining = False
        self.prompt_chars = self.matched_chars = 0
        self._rr = 0  # round-robin cursor for load-routed ties
        self.recent: deque[tuple[str, str, str]] = deque(maxlen=1024)  # (client id, replica, reason)
        self._server = None
        self._health: asyncio.Task | None = None
        r = self._registry = CollectorRegistry()
        self._requests = Counter("tokenloom_router_requests", "Requests routed", ["replica", "reason"], registry=r)
        self._in_flight = Gauge("tokenloom_router_in_flight", "Requests in flight", ["replica"], registry=r)
        self._up = Gauge("tokenloom_router_replica_up", "1 while the replica takes requests", ["replica"], registry=r)
        self._failed = Gauge("tokenloom_router_replica_failed_requests",
                             "Requests ended by the replica's loss", ["replica"], registry=r)
        self._index = Gauge("tokenloom_router_prefix_index_chars", "Characters in the replica's prefix index",
                            ["replica"], registry=r)
        self._ratio = Gauge("tokenloom_router_prefix_match_ratio",
                            "Matched prompt characters / prompt characters routed", registry=r)

    @property
    def port(self) -> int:
        return next(iter(self._server.sockets)).getsockname()[1]

    @property
    def url(self) -> str:
        host = self.options.host
        return f"ws://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def start(self) -> None:
        await asyncio.gather(*(self._try_connect(r) for r in self.replicas))
        o = self.options
        self._server = await serve(self._handle, o.host, o.port, max_size=o.max_frame_bytes,
                                   process_request=self._process_request, server_header=None,
                                   select_subprotocol=select_subprotocol)
        self._health = asyncio.create_task(self._watch_health())
        log.info("router_started", port=self.port, replicas=[r.url for r in self.replicas],
                 up=sum(r.state == "up" for r in self.replicas))

    @staticmethod
    async def _try_connect(replica: Replica) -> None:
        with contextlib.suppress(ReplicaDown):
            await replica.connect()

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.options.health_interval_s)
            await asyncio.gather(*(r.probe() for r in self.replicas), return_exceptions=True)

    # ---- routing --------------------------------------------------------------------------
    async def dispatch(self, p: Pending) -> None:
        """Route ``p`` and send it up; a replica that fails before the request leaves is
        skipped and the next choice tried. No replica left: ``engine_unavailable``."""
        o = self.options
        text = canonical_text(p.msg)
        keys = block_hashes(text, o.index_block_chars)
        tried: set[int] = set()
        while not p.client.out.closed:
            cands = [Candidate(i, r.in_flight, r.index.match(keys))
                     for i, r in enumerate(self.replicas) if r.state == "up" and i not in tried]
            if not cands:
                p.client.out.put(Error(code="engine_unavailable", id=p.rid, retry_after_ms=1000,
                                       message="no replica is up; retry later"))
                break
            d = route(cands, len(text), cache_threshold=o.cache_threshold,
                      balance_abs_threshold=o.balance_abs_threshold, rr=self._rr)
            replica = self.replicas[d.index]
            if d.reason == "load":
                self._rr = d.index + 1
            try:
                await replica.connect()
                await replica.submit(p)
            except ReplicaDown:
                tried.add(d.index)
                continue
            replica.routed[d.reason] += 1
            self._requests.labels(replica=replica.url, reason=d.reason).inc()
            self.prompt_chars += len(text)
            self.matched_chars += d.matched
            replica.index.insert(keys)
            self.recent.append((p.rid, replica.url, d.reason))
            return
        p.client.finished(p.rid)

    # ---- HTTP ---------------------------------------------------------------------------
    async def _process_request(self, connection: ServerConnection, request) -> Response | None:
        path = request.path.split("?", 1)[0]
        authorized = self.rules.request_authorized(request)
        if path == "/health":
            return self._health_response(full=authorized)
        if path in ("/metrics", "/stats"):
            if not (authorized or self.options.public_metrics):
                return text_response(401, "missing or invalid API key\n")
            if path == "/stats":
                return json_response(200, await self.stats())
            return text_response(200, self.render_metrics(), CONTENT_TYPE_LATEST)
        if "upgrade" not in request.headers.get("Connection", "").lower():
            return text_response(404, "not found: use /health, /metrics, /stats or a WebSocket upgrade\n")
        refused = refuse_upgrade(request, self.rules, authorized=authorized, draining=self.draining,
                                 num_connections=len(self.clients), max_connections=self.options.max_connections)
        if refused is not None:
            return refused
        if self._session() is None:
            await asyncio.gather(*(self._try_connect(r) for r in self.replicas))
            if self._session() is None:
                return text_response(503, "no replica is up\n")
        return None

    def _session(self):
        return next((r.session for r in self.replicas if r.state == "up" and r.session is not None), None)

    def _health_response(self, *, full: bool) -> Response:
        up = any(r.state == "up" for r in self.replicas)
        status = "draining" if self.draining else "ok" if up else "unavailable"
        body: dict = {"status": status}
        if full:
            body["replicas"] = [{"url": r.url, "state": r.state, "reason": r.reason, "in_flight": r.in_flight}
                                for r in self.replicas]
        return json_response(200 if status == "ok" else 503, body)

    async def stats(self) -> dict:
        """The router's counters, and each replica's own prefix-cache figures from its /stats."""
        theirs = await asyncio.gather(*(r.fetch_stats() for r in self.replicas))
        replicas = []
        for r, s in zip(self.replicas, theirs, strict=True):
            engine = (s or {}).get("stats", {})
            replicas.append({"url": r.url, "state": r.state, "reason": r.reason, "in_flight": r.in_flight,
                             "routed": sum(r.routed.values()), "cache_routed": r.routed["cache"],
                             "load_routed": r.routed["load"], "failed": r.failed, "index_chars": r.index.chars,
                             "prefix_hit_rate": engine.get("prefix_hit_rate"),
                             "prefix_queries": engine.get("prefix_queries"), "prefix_hits": engine.get("prefix_hits"),
                             "prompt_tokens": engine.get("prompt_tokens")})
        queries = sum(r["prefix_queries"] or 0 for r in replicas)
        return {"replicas": replicas, "match_rate": self.match_rate, "prompt_chars": self.prompt_chars,
                # the replicas' prefix caches together: tokens found / tokens looked up
                "prefix_hit_rate": sum(r["prefix_hits"] or 0 for r in replicas) / queries if queries else None,
                "matched_chars": self.matched_chars, "cache_threshold": self.options.cache_threshold,
                "balance_abs_threshold": self.options.balance_abs_threshold}

    @property
    def match_rate(self) -> float:
        return self.matched_chars / self.prompt_chars if self.prompt_chars else 0.0

    def render_metrics(self) -> str:
        for r in self.replicas:
            self._in_flight.labels(replica=r.url).set(r.in_flight)
            self._up.labels(replica=r.url).set(1 if r.state == "up" else 0)
            self._failed.labels(replica=r.url).set(r.failed)
            self._index.labels(replica=r.url).set(r.index.chars)
        self._ratio.set(self.match_rate)
        return generate_latest(self._registry).decode()

    # ---- connections and shutdown ---------------------------------------------------------
    async def _handle(self, ws: ServerConnection) -> None:
        session = self._session()
        if session is None:  # every replica went down during the handshake
            await ws.close(1013, "no replica is up")
            return
        conn = ClientConnection(self, ws, session)
        self.clients.add(conn)
        try:
            await conn.run()
        finally:
            self.clients.discard(conn)

    async def shutdown(self, deadline_s: float | None = None) -> None:
        """Stop accepting; let requests in flight finish until the deadline; cancel the rest
        (each still gets its ``done`` from its replica, or one saying the replica is gone);
        close every client with 1001, then the upstream connections."""
        deadline_s = self.options.shutdown_deadline_s if deadline_s is None else deadline_s
        self.draining = True
        if self._server is not None:
            self._server.close(close_connections=False)
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while any(r.in_flight for r in self.replicas) and loop.time() < end:
            await asyncio.sleep(0.05)
        for conn in list(self.clients):
            conn.cancel_all()
        end = loop.time() + 2.0
        while any(r.in_flight for r in self.replicas) and loop.time() < end:
            await asyncio.sleep(0.05)
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        for r in self.replicas:
            await r.close()
        for conn in list(self.clients):
            await conn.drain_and_close(1001, "router shutting down")
        if self._server is not None:
            await self._server.wait_closed()
        log.info("router_stopped")
