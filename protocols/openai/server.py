"""The ``openai`` frontend: OpenAI's HTTP API over the engine, on Starlette and uvicorn.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true`` answers with server-sent events, ended by
``data: [DONE]``), ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``,
``GET /health`` (the status; with the key the engine's state too, as on the WebSocket port)
and ``GET /metrics`` (Prometheus, the whole server's; needs the key unless ``--public-metrics``).

LoRA adapters, as vLLM serves them (``--lora NAME=PATH``, ``--enable-lora``): a request's
``model`` names the base model or an adapter (the request then runs under it, and its
answer's ``model`` says the adapter's name); ``/v1/models`` lists one card per adapter
after the base's, with vLLM's ``root`` (the adapter's path) and ``parent`` (the base
model's id). ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` need the API key like every route, and
answer 200 with vLLM's plain-text line (``Success: LoRA adapter 'x' added successfully.`` /
``... removed successfully.``); errors are JSON as everywhere: 400 for a bad body (naming
the field), a name taken (or the base model's), adapter files that cannot be served (the
reason, ``param: lora_path``, ``code: invalid_adapter``) or a server started without an
adapter role (``code: lora_not_enabled``), 404 (``not_found``) for unloading an unknown
name, 503 while the engine restarts. An unload waits for the requests running under the
adapter to finish (they end normally); new requests naming it get 404 from the start.

The rules are the gateway's, shared with the WebSocket frontend: the same API key
(``Authorization: Bearer``), the same browser Origin list (with CORS headers for listed
Origins), one queue limit, one connection count. Connections
(connection.py): a request head must arrive within ``--http-header-timeout`` and its body
within ``--http-body-timeout`` (else 408 and close), an idle keep-alive connection is
closed after ``--http-keepalive-timeout``, and a connection over ``--max-connections`` or
``--max-connections-per-client`` (counted with the WebSocket port's) gets 503 and is
closed; all of it counted in /metrics, not logged line by line. Status codes are the ones the
official client maps to its exceptions: 400 (``BadRequestError``, the ``param`` named),
401, 403, 404 (unknown model or route), 413 (body over ``max_body_bytes``), 429 (rate
limit) and 503 (queue full, shutting down, engine restarting), both with ``Retry-After``.
An engine step that fails under a request is a 503 ``engine_error`` too, not a 500, with
the failure in the error body (``{"error": {"message", "type": "server_error", "code"}}``,
``Retry-After`` while the engine restarts); a streamed answer gets an ``error`` event
instead, its 200 being already sent. Only a bug in the server itself is a 500. Error
messages quote a client's value (model name, path, Origin, ...) cut to 100 characters.
A client that disconnects — mid-stream or while waiting for a whole answer — aborts its
request, whose KV blocks come back at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections import OrderedDict

import msgspec
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from tokenloom.core import tools
from tokenloom.core.errors import ClientError, ConfigError, EngineUnavailable, quoted
from tokenloom.protocols.connections import install_accept_guard
from tokenloom.protocols.gateway import RateLimited, Refused
from tokenloom.protocols.metrics import health_body
from tokenloom.protocols.openai import schema
from tokenloom.protocols.openai.answer import Answer
from tokenloom.protocols.openai.connection import QuietProtocolErrors, http_protocol
from tokenloom.protocols.openai.rules import HTTPError, Rules, client_error, refused
from tokenloom.protocols.ratelimit import RateLimiter

log = structlog.get_logger("tokenloom.openai")
MAX_CLIENTS_TRACKED = 4096  # rate-limit buckets kept, least recently seen dropped first


#: an oversized body up to this size is read to its end before the 413 (see _drain)
DRAIN_BYTES = 8 << 20

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
        self.tool_parser = tools.build_parser(self.engine.pm, self.engine.config.engine.tool_call_parser,
                                              self.engine.tokenizer.chat_template)
        self.native_tools = tools.template_reads_tools(self.engine.tokenizer.chat_template)
        self.active: set[str] = set()  # engine ids of requests being answered
        self.background: set[asyncio.Task] = set()
        self._limiters: OrderedDict[str, RateLimiter] = OrderedDict()
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None
        self._quiet: logging.Filter | None = None
        self._port = 0
        self.app = Starlette(routes=[
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ])
        self.app.add_exception_handler(404, self._not_found)
        self.app.add_exception_handler(405, self._not_allowed)
        self.app.add_middleware(Rules, gateway=self.gateway)

    # ---- lifecycle (the Frontend protocol) ---------------------------------------------
    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.options.port), family=family)
        self._port = sock.getsockname()[1]
        o = self.gateway.options
        install_accept_guard(asyncio.get_running_loop(), self.gateway.metrics)
        self._quiet = QuietProtocolErrors(self.gateway.metrics)
        logging.getLogger("uvicorn.error").addFilter(self._quiet)
        # h11 with read deadlines, counted in the gateway's connection limits; no WebSocket
        # upgrades on this port (the WebSocket frontend has its own)
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5, server_header=False,
                                http=http_protocol(self.gateway), ws="none",
                                timeout_keep_alive=o.http_keepalive_timeout_s)
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
        """New requests get 503 ``shutting_down`` (the port stays open until :meth:`close`,
        so that they hear why)."""
        self.gateway.draining = True

    async def close(self) -> None:
        for rid in list(self.active):  # each still ends with its finish chunk or its response
            self.engine.abort(rid)
        loop = asyncio.get_running_loop()
        end = loop.time() + 5.0
        while self.active and loop.time() < end:
            await asyncio.sleep(0.01)
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
        logging.getLogger("uvicorn.error").removeFilter(self._quiet)

    # ---- routes -------------------------------------------------------------------------
    def _model_card(self, adapter=None) -> dict:
        """The base model's card, or an adapter's (vLLM's ``root``: its path, ``parent``: the base)."""
        if adapter is None:
            return {"id": self.model, "object": "model", "created": 0, "owned_by": "tokenloom",
                    "root": self.engine.config.engine.model, "parent": None,
                    "max_model_len": self.engine.max_model_len}
        return {"id": adapter.name, "object": "model", "created": 0, "owned_by": "tokenloom", "root": adapter.path,
                "parent": self.model, "max_model_len": self.engine.max_model_len}

    def _adapters(self) -> dict:
        return {a.name: a for a in self.engine.adapters()} if self.engine.config.adapter is not None else {}

    def _served(self, model) -> str | None:
        """What a request's ``model`` names: None for the base model, else the adapter's
        name; a 404 ``model_not_found`` for anything else."""
        if model in self.aliases:
            return None
        adapters = self._adapters()
        if model in adapters:
            return model
        also = f" and {len(adapters)} LoRA adapter(s) (see /v1/models)" if adapters else ""
        raise HTTPError(404, f"The model {quoted(model)} does not exist; this server serves {self.model!r}{also}",
                        param="model", code="model_not_found")

    async def list_models(self, request: Request) -> Response:
        cards = [self._model_card()] + [self._model_card(a) for a in self._adapters().values()]
        return schema.json_response({"object": "list", "data": cards})

    async def get_model(self, request: Request) -> Response:
        name = self._served(request.path_params["model_id"])
        return schema.json_response(self._model_card(None if name is None else self._adapters()[name]))

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's route: load a PEFT LoRA directory under a name requests can then give as ``model``."""
        req = schema.decode_body(await self._body(request), schema.LoadLoraAdapterRequest)
        self._adapter_role()
        if req.lora_name in self.aliases:
            raise HTTPError(400, f"lora_name {quoted(req.lora_name)} is the base model's name", param="lora_name",
                            code="invalid_request")
        await self._adapter_call(self.engine.load_adapter(req.lora_name, req.lora_path))
        log.info("lora_adapter_loaded", adapter=req.lora_name, path=req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's route: stop serving an adapter (once the requests running under it have ended)."""
        req = schema.decode_body(await self._body(request), schema.UnloadLoraAdapterRequest)
        self._adapter_role()
        await self._adapter_call(self.engine.unload_adapter(req.lora_name))
        log.info("lora_adapter_unloaded", adapter=req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    def _adapter_role(self) -> None:
        if self.engine.config.adapter is None:
            raise HTTPError(400, "this server serves no LoRA adapters: start it with --enable-lora (adapters loaded "
                                 "at run time) or --lora NAME=PATH", code="lora_not_enabled")

    @staticmethod
    async def _adapter_call(call) -> None:
        """Await a load or unload; its errors as HTTP ones (ClientError and NotFound pass to
        the middleware: 400, 404)."""
        try:
            await call
        except EngineUnavailable as exc:
            raise HTTPError(503, str(exc), code=exc.code, kind="server_error",
                            retry_after_ms=exc.retry_after_ms) from None
        except ConfigError as exc:  # the adapter's files, its rank, its size, a merged engine ...
            raise HTTPError(400, str(exc), param="lora_path", code="invalid_adapter") from None

    async def health(self, request: Request) -> Response:
        """As on the WebSocket port: the status alone, and with the API key (or none set)
        the engine's counters, KV blocks, failures and memory too."""
        full = self.gateway.rules.bearer_authorized(request.headers.get("authorization"))
        if full:
            await self.engine.refresh_stats()
        status, body = health_body(self.engine, draining=self.gateway.draining, full=full)
        return schema.json_response(body, status)

    async def prometheus(self, request: Request) -> Response:
        """Prometheus metrics of the whole server (every frontend's)."""
        m = self.gateway.metrics
        await self.engine.refresh_stats()
        return Response(m.render(), media_type=m.content_type)

    async def chat_completions(self, request: Request) -> Response:
        req = schema.decode_request(await self._body(request), schema.ChatCompletionRequest)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        asked = schema.tool_request(req)
        messages = tools.chat_messages(schema.chat_messages(req), asked, self.tool_parser, self.native_tools)
        return await self._generate(request, req, "chat.completion", num_logprobs, messages=messages, tool_request=asked,
                                    tools=asked.tools if asked is not None and self.native_tools else None)

    async def completions(self, request: Request) -> Response:
        req = schema.decode_request(await self._body(request), schema.CompletionRequest)
        prompt = schema.completion_prompt(req)
        return await self._generate(request, req, "text_completion", req.logprobs, prompt=prompt,
                                    echo_text=prompt if isinstance(prompt, str) else None)

    # ---- one request ----------------------------------------------------------------------
    async def _body(self, request: Request) -> bytes:
        limit = self.options.max_body_bytes
        too_big = HTTPError(413, f"the request body is over {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._drain(request, int(declared))
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                await self._drain(request, None)
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    async def _drain(request: Request, declared: int | None) -> None:
        """Read and drop the rest of an oversized body (up to ``DRAIN_BYTES``) before the 413:
        a client still sending when the answer comes gets a reset, not the answer."""
        if declared is not None and declared > DRAIN_BYTES:
            return
        seen = 0
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > DRAIN_BYTES:
                return

    def _limiter(self, request: Request) -> RateLimiter:
        client = request.client.host if request.client else "?"
        limiter = self._limiters.pop(client, None) or RateLimiter(self.gateway.options.rate_limits)
        self._limiters[client] = limiter
        while len(self._limiters) > MAX_CLIENTS_TRACKED:
            self._limiters.popitem(last=False)
        return limiter

    async def _generate(self, request: Request, req, kind: str, num_logprobs: int | None, *,
                        echo_text: str | None = None, tool_request: tools.ToolRequest | None = None,
                        **prompt) -> Response:
        """Admission through the gateway (reserve a queue slot, charge the rate limits,
        tokenise, submit), then the answer."""
        adapter = self._served(req.model)
        gateway, limiter = self.gateway, self._limiter(request)
        tool_constraint = tools.constraint(tool_request, self.tool_parser) if tool_request is not None else None
        params, open_ended = schema.sampling_params(req, num_logprobs, tool_constraint)
        if adapter is not None:
            params = msgspec.structs.replace(params, adapter=adapter)
        try:
            gateway.reserve()
            try:
                gateway.take_request(limiter)
            except RateLimited:
                gateway.release()
                raise
            state = await gateway.admit(params=params, limiter=limiter, request_id=f"oai-{uuid.uuid4().hex}",
                                        fill_max_tokens=open_ended, reserved=True, **prompt)
        except Refused as exc:
            raise refused(exc.refusal) from None
        except RateLimited as exc:
            raise HTTPError(429, str(exc), code="rate_limit_exceeded", kind="rate_limit_error",
                            retry_after_ms=exc.wait_ms) from None
        except EngineUnavailable as exc:
            raise HTTPError(503, str(exc), code=exc.code, kind="server_error",
                            retry_after_ms=exc.retry_after_ms) from None
        except ClientError as exc:
            raise client_error(exc, req) from None
        parser = self.tool_parser if tool_request is not None and tool_request.parses else None
        answer = Answer(self, req, kind, state, prompt_text=echo_text, tool_parser=parser)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return answer.events_response(include_usage, gateway.options.send_timeout_s)
        return await answer.whole(request)

    # ---- errors ---------------------------------------------------------------------------
    async def _not_found(self, request: Request, exc) -> Response:
        return HTTPError(404, f"no route {quoted(request.url.path)}; see /v1/models, /v1/completions, "
                              "/v1/chat/completions, /v1/load_lora_adapter, /v1/unload_lora_adapter",
                         code="not_found").response()

    async def _not_allowed(self, request: Request, exc) -> Response:
        return HTTPError(405, f"{quoted(request.method)} is not allowed on {quoted(request.url.path)}",
                         code="method_not_allowed").response()
