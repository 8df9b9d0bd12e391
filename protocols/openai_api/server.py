"""The ``openai`` frontend: OpenAI's HTTP API over the engine, on Starlette and uvicorn.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` answers with server-sent events, ended by
``data: [DONE]``), and ``GET /health``. The rules are the gateway's, shared with the
WebSocket frontend: the same API key (``Authorization: Bearer``), the same browser Origin
list (with CORS headers for listed Origins), one queue limit. Status codes are the ones the
official client maps to its exceptions: 400 (``BadRequestError``, the ``param`` named),
401, 403, 404 (unknown model or route), 413 (body over ``max_body_bytes``), 429 (rate
limit) and 503 (queue full, shutting down, engine restarting), both with ``Retry-After``.
A client that disconnects — mid-stream or while waiting for a whole answer — aborts its
request, whose KV blocks come back at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import time
import uuid
from collections import OrderedDict

import msgspec
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tokenloom.core.errors import ClientError, EngineUnavailable, RequestTooLong
from tokenloom.core.outputs import Finished
from tokenloom.protocols.gateway import RateLimited, Refusal
from tokenloom.protocols.openai_api import schema
from tokenloom.protocols.ratelimit import RateLimiter

log = structlog.get_logger("tokenloom.openai")
_encode = msgspec.json.Encoder().encode
MAX_CLIENTS_TRACKED = 4096  # rate-limit buckets kept, least recently seen dropped first


class HTTPError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", retry_after_ms: int | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.type, self.retry_after_ms = status, param, code, type, retry_after_ms

    def response(self, headers: dict | None = None) -> Response:
        headers = dict(headers or {})
        if self.retry_after_ms is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_ms / 1000)))
        body = schema.error_body(str(self), type=self.type, param=self.param, code=self.code)
        return Response(_encode(body), self.status, headers, media_type="application/json")


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """`tokenloom serve` owns SIGINT/SIGTERM (one drain for every frontend)."""
        yield


class OpenAIFrontend:
    name = "openai"

    def __init__(self, options, context):
        self.options, self.engine, self.gateway = options, context.engine, context.gateway
        self.host = context.host
        # The name clients send as `model`: as vLLM does, the --model the server was started
        # with (`smollm2-135m`) unless served_model_name says otherwise; the checkpoint's own
        # name is accepted too.
        self.model = options.served_model_name or self.engine.config.engine.model
        self.aliases = {self.model, self.engine.model_name}
        self.active: set[str] = set()  # engine ids of requests being answered
        self._limiters: OrderedDict[str, RateLimiter] = OrderedDict()
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None
        self._port = 0
        self.app = Starlette(routes=[
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
        ])
        self.app.add_exception_handler(404, self._not_found)
        self.app.add_exception_handler(405, self._not_allowed)
        self.app.add_middleware(_Rules, frontend=self)

    # ---- lifecycle (the Frontend protocol) ---------------------------------------------
    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.options.port), family=family)
        self._port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5, server_header=False)
        self._server = _Uvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="tokenloom-openai")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the OpenAI frontend stopped while starting")
            await asyncio.sleep(0.01)
        log.info("openai_started", host=self.host, port=self._port, model=self.model)

    @property
    def port(self) -> int:
        return self._port

    def urls(self) -> list[str]:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return [f"http://{host}:{self._port}/v1"]

    def stop_accepting(self) -> None:
        self.gateway.draining = True

    async def close(self) -> None:
        for rid in list(self.active):  # each still ends with its final chunk or response
            self.engine.abort(rid)
        loop = asyncio.get_running_loop()
        end = loop.time() + 5.0
        while self.active and loop.time() < end:
            await asyncio.sleep(0.01)
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task

    # ---- routes -------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "tokenloom",
                "max_model_len": self.engine.max_model_len}

    async def list_models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id not in self.aliases:
            raise HTTPError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")
        return _json(self._model_card())

    async def health(self, request: Request) -> Response:
        status = "draining" if self.gateway.draining else self.engine.health_report().status
        return _json({"status": status}, 200 if status == "ok" else 503)

    async def chat_completions(self, request: Request) -> Response:
        req = schema.decode_request(await self._body(request), schema.ChatCompletionRequest)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return await self._generate(request, req, "chat.completion", num_logprobs,
                                    messages=schema.chat_messages(req))

    async def completions(self, request: Request) -> Response:
        req = schema.decode_request(await self._body(request), schema.CompletionRequest)
        return await self._generate(request, req, "text_completion", req.logprobs,
                                    prompt=schema.completion_prompt(req))

    # ---- one request ----------------------------------------------------------------------
    async def _body(self, request: Request) -> bytes:
        limit = self.options.max_body_bytes
        too_big = HTTPError(413, f"the request body is over {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def _limiter(self, request: Request) -> RateLimiter:
        client = request.client.host if request.client else "?"
        limiter = self._limiters.pop(client, None) or RateLimiter(self.gateway.options.rate_limits)
        self._limiters[client] = limiter
        while len(self._limiters) > MAX_CLIENTS_TRACKED:
            self._limiters.popitem(last=False)
        return limiter

    async def _generate(self, request: Request, req, kind: str, num_logprobs: int | None, **prompt) -> Response:
        if req.model not in self.aliases:
            raise HTTPError(404, f"The model `{req.model}` does not exist; this server serves `{self.model}`",
                            param="model", code="model_not_found")
        if refusal := self.gateway.refusal():
            raise _refused(refusal)
        limiter = self._limiter(request)
        params, open_ended = schema.sampling_params(req, num_logprobs)
        rid = f"oai-{uuid.uuid4().hex}"
        try:
            self.gateway.take_request(limiter)
            state = await self.gateway.admit(params=params, limiter=limiter, request_id=rid,
                                             fill_max_tokens=open_ended, **prompt)
        except RateLimited as exc:
            raise HTTPError(429, str(exc), code="rate_limit_exceeded", type="rate_limit_error",
                            retry_after_ms=exc.wait_ms) from None
        except EngineUnavailable as exc:
            raise HTTPError(503, str(exc), code=exc.code, type="server_error",
                            retry_after_ms=exc.retry_after_ms) from None
        except ClientError as exc:
            raise _client_error(exc, req) from None
        self.active.add(rid)
        answer = _Answer(self, req, kind, rid)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _EventStream(answer.events(state, include_usage), lambda: answer.close(state))
        try:
            return await answer.whole(state, request)
        finally:
            self.active.discard(rid)

    # ---- errors ---------------------------------------------------------------------------
    async def _not_found(self, request: Request, exc) -> Response:
        return HTTPError(404, f"no route {request.url.path}; see /v1/models, /v1/completions, "
                              "/v1/chat/completions", code="not_found").response()

    async def _not_allowed(self, request: Request, exc) -> Response:
        return HTTPError(405, f"{request.method} is not allowed on {request.url.path}",
                         code="method_not_allowed").response()


class _Answer:
    """One accepted request's response: whole, or as server-sent events."""

    def __init__(self, frontend: OpenAIFrontend, req, kind: str, rid: str):
        self.frontend, self.req, self.kind, self.rid = frontend, req, kind, rid
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + rid.removeprefix("oai-")
        self.created = int(time.time())
        self.tokenizer = frontend.engine.tokenizer
        self.finished = False  # the final result was seen

    def _logprobs(self, entries, text_offset: int):
        if not entries:
            return None
        if self.kind == "chat.completion":
            return schema.chat_logprobs(self.tokenizer, entries)
        return schema.completion_logprobs(self.tokenizer, entries, text_offset)

    def _choice(self, text: str, logprobs, reason: str | None, *, stream: bool) -> dict:
        if self.kind == "text_completion":
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        body = ({"content": text} if reason is None else {}) if stream else {"role": "assistant", "content": text}
        return {"index": 0, ("delta" if stream else "message"): body, "logprobs": logprobs, "finish_reason": reason}

    def _envelope(self, choices: list, *, stream: bool, **extra) -> dict:
        obj = self.kind + (".chunk" if stream and self.kind == "chat.completion" else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.frontend.model,
                "choices": choices, **extra}

    async def whole(self, state, request: Request) -> Response:
        """Collect the answer; a client that hangs up first aborts it."""
        engine = self.frontend.engine
        collect = asyncio.ensure_future(_collect(engine.stream(state)))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():  # the client left: abort; the stream still ends with Finished
            engine.abort(self.rid)
        final, entries = await collect
        gone.cancel()
        self.frontend.gateway.metrics.observe_finished(final.finish_reason, final)
        if final.finish_reason == "error":
            raise HTTPError(500, f"the engine failed on this request: {final.error}", type="server_error",
                            code="engine_error")
        choice = self._choice(final.text, self._logprobs(entries, 0), schema.finish_reason(final.finish_reason),
                              stream=False)
        return _json(self._envelope([choice], stream=False, usage=schema.usage_body(final.usage)))

    async def events(self, state, include_usage: bool):
        """SSE: a role chunk (chat), content chunks, the finish chunk, the usage chunk when
        asked, ``[DONE]``. Leaving early (the client hung up) aborts the request."""
        usage_none = {"usage": None} if include_usage else {}
        offset = 0
        try:
            if self.kind == "chat.completion":
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield _sse(self._envelope([first], stream=True, **usage_none))
            async for item in self.frontend.engine.stream(state):
                if isinstance(item, Finished):
                    self.finished = True
                    self.frontend.gateway.metrics.observe_finished(item.finish_reason, item)
                    if item.finish_reason == "error":
                        err = schema.error_body(f"the engine failed on this request: {item.error}",
                                                type="server_error", code="engine_error")
                        yield _sse(err)
                    else:
                        reason = schema.finish_reason(item.finish_reason)
                        yield _sse(self._envelope([self._choice("", None, reason, stream=True)], stream=True,
                                                  **usage_none))
                        if include_usage:
                            yield _sse(self._envelope([], stream=True, usage=schema.usage_body(item.usage)))
                    break
                if not item.text and not item.logprobs:
                    continue
                logprobs = self._logprobs(item.logprobs, offset)
                offset += len(item.text)
                yield _sse(self._envelope([self._choice(item.text, logprobs, None, stream=True)], stream=True,
                                          **usage_none))
            yield b"data: [DONE]\n\n"
        finally:
            self.close(state)

    def close(self, state) -> None:
        """The response is over: abort the request if it still runs (the client left), and
        count its end in the metrics once the engine has ended it."""
        self.frontend.active.discard(self.rid)
        if not self.finished and self.frontend.engine.abort(self.rid):
            self.finished = True
            asyncio.ensure_future(self._count_abort(state))

    async def _count_abort(self, state) -> None:
        async for item in self.frontend.engine.stream(state):
            if isinstance(item, Finished):
                self.frontend.gateway.metrics.observe_finished(item.finish_reason, item)


class _EventStream(StreamingResponse):
    """Server-sent events that abort their request however the response ends: the client
    hung up mid-stream, before the first event, or the server is closing."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self._on_close()


class _Rules:
    """ASGI middleware: the gateway's API key and Origin rules for every route but /health,
    CORS headers for listed browser Origins, and the error shape for what a route raises."""

    def __init__(self, app, frontend: OpenAIFrontend):
        self.app, self.frontend = app, frontend

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        gateway = self.frontend.gateway
        origin = request.headers.get("origin")
        cors = {}
        if origin is not None and gateway.options.allowed_origins:
            cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        try:
            if not gateway.origin_allowed(origin, request.headers.get("host")):
                raise HTTPError(403, f"Origin {origin!r} is not allowed", code="origin_not_allowed")
            if request.method == "OPTIONS" and origin is not None:  # a CORS preflight
                return await Response(status_code=204, headers={
                    **cors, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": "Authorization, Content-Type", "Access-Control-Max-Age": "600",
                })(scope, receive, send)
            if request.url.path != "/health" and not gateway.bearer_authorized(request.headers.get("authorization")):
                raise HTTPError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                                code="invalid_api_key")
            await self.app(scope, receive, _with_headers(send, cors))
        except HTTPError as exc:
            await exc.response(cors)(scope, receive, send)
        except ClientError as exc:
            await _client_error(exc, None).response(cors)(scope, receive, send)
        except ClientDisconnect:
            return
        except Exception:
            log.exception("openai_request_failed", path=request.url.path)
            with contextlib.suppress(Exception):  # fails if the response had started
                await HTTPError(500, "the server failed on this request", type="server_error",
                                code="internal_error").response(cors)(scope, receive, send)


def _with_headers(send, headers: dict):
    if not headers:
        return send
    extra = [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped


def _client_error(exc: ClientError, req) -> HTTPError:
    param = exc.param
    if param == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
        param = "max_completion_tokens"  # name the field the client sent
    message = str(exc).replace("max_tokens", param) if param == "max_completion_tokens" else str(exc)
    code = "context_length_exceeded" if isinstance(exc, RequestTooLong) else exc.code
    return HTTPError(400, message, param=param, code=code)


def _refused(refusal: Refusal) -> HTTPError:
    return HTTPError(503, refusal.message, code=refusal.code, type="server_error",
                     retry_after_ms=refusal.retry_after_ms if refusal.retry_after_ms is not None else 1000)


async def _collect(stream) -> tuple[Finished, list]:
    entries = []
    async for item in stream:
        if isinstance(item, Finished):
            return item, entries
        entries.extend(item.logprobs or ())
    raise RuntimeError("the engine's stream ended without a final result")


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so the next ASGI message
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _json(body: dict, status: int = 200) -> Response:
    return Response(_encode(body), status, media_type="application/json")


def _sse(body: dict) -> bytes:
    return b"data: " + _encode(body) + b"\n\n"
