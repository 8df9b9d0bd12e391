"""What every frontend of one `tokenloom serve` shares, and the host that mounts them.

One engine, several ways in (the WebSocket protocol, the OpenAI HTTP API, ...), one set of
rules: the same API key, the same browser Origin list, one queue limit counted over all of
them, the same rate-limit settings, one Prometheus registry, and one shutdown. A frontend
speaks its own wire format; the :class:`Gateway` decides who gets in.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field

import msgspec
import structlog

from tokenloom.core import contracts
from tokenloom.core.errors import EngineUnavailable
from tokenloom.core.interfaces import Frontend, FrontendContext
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.protocols.connections import ConnectionLimits
from tokenloom.protocols.http import AccessRules
from tokenloom.protocols.metrics import ServerMetrics
from tokenloom.protocols.ratelimit import RateLimiter, RateLimits

log = structlog.get_logger("tokenloom.server")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(slots=True)
class ServerOptions:
    """Settings of `tokenloom serve`. ``port`` and the frame/send limits are the WebSocket
    frontend's, the ``http_*`` timeouts the OpenAI frontend's (the header timeout bounds
    the WebSocket handshake too); the rest hold for every frontend. ``max_connections``
    counts TCP connections on every frontend's port together (protocols/connections.py)."""

    host: str = "127.0.0.1"
    port: int = 8765
    api_key: str | None = None
    allowed_origins: list[str] | None = None  # browser Origins; clients without one pass
    max_connections: int = 1024  # open connections, all frontends together
    max_connections_per_client: int = 256  # of those, per client address (0: no per-address cap)
    http_header_timeout_s: float = 10.0  # a connection's request head must arrive within this
    http_body_timeout_s: float = 30.0  # and its body within this of the head
    http_keepalive_timeout_s: float = 5.0  # an idle connection between requests is closed after this
    max_queue: int = 256  # unfinished requests in the engine before `overloaded`
    max_requests_per_connection: int = 256
    max_frame_bytes: int = 1 << 20
    send_timeout_s: float = 10.0
    max_pending_bytes: int = 8 << 20  # unsent output a connection may hold before it is cut
    default_timeout_s: float | None = None  # a request's deadline when it sets no timeout_s
    rate_limits: RateLimits = field(default_factory=RateLimits)  # per connection (HTTP: per client address)
    public_metrics: bool = False  # serve /metrics and /stats without the API key (for a scraper)
    shutdown_deadline_s: float = 30.0
    retry_after_ms: int = 1000
    write_limit_bytes: int = 1 << 16  # websockets' write-buffer high-water mark
    socket_send_buffer: int | None = None  # SO_SNDBUF for accepted sockets (tests shrink it)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a new request cannot be taken now; every frontend words it its own way."""

    code: str  # shutting_down | overloaded
    message: str
    retry_after_ms: int | None = None


class Refused(Exception):
    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal


class RateLimited(Exception):
    def __init__(self, wait_ms: int, what: str):
        super().__init__(f"over the {what} per minute limit; retry in {wait_ms} ms")
        self.wait_ms, self.what = wait_ms, what


class Gateway:
    """Admission, in this order: :meth:`reserve` a queue slot (synchronously, so a burst
    of requests cannot all pass the check before any of them is counted), charge the
    request rate (:meth:`take_request`; :meth:`release` the slot if that refuses), then
    :meth:`admit`, which releases the slot whatever happens."""

    def __init__(self, engine, options: ServerOptions | None = None):
        self.engine = engine
        self.options = options or ServerOptions()
        self.metrics = ServerMetrics(engine)
        self.connections = ConnectionLimits(self.options.max_connections, self.options.max_connections_per_client,
                                            self.metrics)
        # who may come in: the key and Origin rules every frontend applies (protocols/http.py)
        self.rules = AccessRules(self.options.api_key, tuple(self.options.allowed_origins or ()))
        self.num_admitting = 0  # requests holding a slot but not yet submitted (they count towards max_queue)
        self.draining = False

    # ---- admission --------------------------------------------------------------------
    def refusal(self) -> Refusal | None:
        """Why a new request must wait, or None: shutting down, or the queue is full."""
        if self.draining:
            return Refusal("shutting_down", "the server is shutting down")
        queued = self.engine.num_unfinished + self.num_admitting
        if queued >= self.options.max_queue:
            self.metrics.overloaded.inc()
            return Refusal("overloaded", f"{queued} requests queued; retry later", self.options.retry_after_ms)
        return None

    def reserve(self) -> None:
        """Take a queue slot now, or raise Refused. The slot is given back by :meth:`admit`
        (pass ``reserved=True``) or by :meth:`release`."""
        if refusal := self.refusal():
            raise Refused(refusal)
        self.num_admitting += 1

    def release(self) -> None:
        self.num_admitting -= 1

    async def wait_drained(self, deadline_s: float) -> None:
        """Wait, at most ``deadline_s``, until nothing runs and nothing is being admitted."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        while (self.engine.num_unfinished or self.num_admitting) and loop.time() < end:
            await asyncio.sleep(0.05)

    def take_request(self, limiter: RateLimiter) -> None:
        """Charge one request to ``limiter``; raises RateLimited."""
        if wait := limiter.take_request():
            self.metrics.rate_limited.inc()
            raise RateLimited(wait, "requests")

    async def admit(self, *, params: SamplingParams, limiter: RateLimiter, request_id: str,
                    prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                    parse_special_tokens: bool | None = None, cache_salt: str | None = None,
                    fill_max_tokens: bool = False, reserved: bool = False, tools: list[dict] | None = None):
        """Validate, tokenise off the event loop, charge ``limiter``'s tokens, submit: the
        engine's request state. ``reserved``: the caller holds a slot from :meth:`reserve`
        (else one is taken here). ``fill_max_tokens``: the request gave no max_tokens, so it
        may use the rest of the context or of the KV pool (vLLM's default). With ``params.n >
        1`` the state returned is sample 0's; ``state.samples`` holds all n. Raises Refused
        (full, or shutting down — checked again after tokenising, so nothing is submitted
        once a drain has begun), ClientError (bad input, naming the parameter), RateLimited,
        or EngineUnavailable."""
        engine, o = self.engine, self.options
        if not reserved:
            self.reserve()
        try:
            if params.timeout_s is None and o.default_timeout_s is not None:
                params = msgspec.structs.replace(params, timeout_s=o.default_timeout_s)
            params.validate(engine.model_config.vocab_size)  # before spending time on the prompt
            ids = await engine.prompt_ids_async(prompt, messages, parse_special_tokens, tools)
            if fill_max_tokens:  # the rest of the context, or of the KV pool where that is smaller
                room = min(engine.max_model_len, engine.kv_capacity_tokens) - len(ids)
                params = msgspec.structs.replace(params, max_tokens=max(1, room))
            if wait := limiter.take_tokens(len(ids) + params.n * params.max_tokens):  # n samples, one prompt
                self.metrics.rate_limited.inc()
                raise RateLimited(wait, "tokens")
            if self.draining:
                raise Refused(Refusal("shutting_down", "the server is shutting down"))
            return await engine.submit_async(ids, params, request_id=request_id, cache_salt=cache_salt)
        except EngineUnavailable:
            self.metrics.engine_unavailable.inc()
            raise
        finally:
            self.release()


class FrontendHost:
    """Mounts the frontends the config enables over one engine and shuts them down together:
    stop accepting everywhere, let running requests finish until the deadline, then each
    frontend aborts what is left and closes."""

    def __init__(self, engine, options: ServerOptions, plugin_manager=None):
        self.engine, self.options = engine, options
        self.pm = plugin_manager or engine.pm
        self.gateway = Gateway(engine, options)
        self.frontends: list[Frontend] = []

    async def start(self) -> None:
        o = self.options
        if o.host not in LOOPBACK and not o.api_key:
            log.warning("binding_without_api_key", host=o.host,
                        hint="anyone who can reach this address can use the model; set TOKENLOOM_API_KEY")
        context = FrontendContext(engine=self.engine, host=o.host, gateway=self.gateway)
        try:
            for chosen in self.engine.config.frontends:
                frontend: Frontend = contracts.build(self.pm.get("frontend", chosen.name), chosen.options, context)
                await frontend.start()
                self.frontends.append(frontend)
        except BaseException:
            await self.shutdown(0)
            raise

    def banner(self) -> str:
        lines = [f"serving {self.engine.model_name}"]
        lines += [f"  {f.name:<10} {'  '.join(f.urls())}" for f in self.frontends]
        return "\n".join(lines)

    async def shutdown(self, deadline_s: float | None = None) -> None:
        deadline_s = self.options.shutdown_deadline_s if deadline_s is None else deadline_s
        self.gateway.draining = True
        for f in self.frontends:
            f.stop_accepting()
        await self.gateway.wait_drained(deadline_s)
        for f in self.frontends:
            try:
                await f.close()
            except Exception as exc:  # one frontend failing to close must not keep the others open
                print(f"frontend {f.name} failed to close: {exc}", file=sys.stderr)
        log.info("server_stopped")
