"""Errors in OpenAI's shape, and the middleware that applies the gateway's rules (browser
Origin, API key) to every route and turns whatever a route raises into such an error."""

from __future__ import annotations

import contextlib
import math

import structlog
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from tokenloom.core.errors import ClientError, NotFound, RequestTooLong, quoted
from tokenloom.protocols.gateway import Refusal
from tokenloom.protocols.openai import schema

log = structlog.get_logger("tokenloom.openai")


class HTTPError(Exception):
    """An error answer: status, message, and OpenAI's ``type`` / ``param`` / ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after_ms: int | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.retry_after_ms = status, param, code, kind, retry_after_ms

    def response(self, headers: dict | None = None) -> Response:
        headers = dict(headers or {})
        if self.retry_after_ms is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_ms / 1000)))
        body = schema.error_body(str(self), kind=self.kind, param=self.param, code=self.code)
        return schema.json_response(body, self.status, headers)


def client_error(exc: ClientError, req=None) -> HTTPError:
    """400 naming the field the client sent (``max_completion_tokens`` where it used that
    name, chat's ``top_logprobs`` for the engine's ``logprobs``); 404 for NotFound (an
    adapter a request's ``model`` named that went away before the engine took the request:
    ``model_not_found``, as an unknown model)."""
    param, message = exc.param, str(exc)
    if isinstance(exc, NotFound):
        if param == "adapter" and isinstance(getattr(req, "model", None), str):
            return HTTPError(404, f"The model {quoted(req.model)} does not exist ({message})", param="model",
                             code="model_not_found")
        return HTTPError(404, message, param=param, code=exc.code)
    if param == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
        param, message = "max_completion_tokens", message.replace("max_tokens", "max_completion_tokens")
    if param == "logprobs" and getattr(req, "top_logprobs", None) is not None:
        param, message = "top_logprobs", message.replace("logprobs", "top_logprobs", 1)
    code = "context_length_exceeded" if isinstance(exc, RequestTooLong) else exc.code
    return HTTPError(400, message, param=param, code=code)


def refused(refusal: Refusal) -> HTTPError:
    """503: full or shutting down, with a Retry-After (1 s when the refusal names none)."""
    retry = refusal.retry_after_ms if refusal.retry_after_ms is not None else 1000
    return HTTPError(503, refusal.message, code=refusal.code, kind="server_error", retry_after_ms=retry)


class Rules:
    """ASGI middleware: the gateway's Origin and API-key rules on every route but /health
    (and /metrics with --public-metrics; a CORS preflight from a listed Origin is answered without the key, as browsers send
    it without credentials), CORS headers for listed Origins, OpenAI-shaped errors."""

    def __init__(self, app, gateway):
        self.app, self.gateway = app, gateway

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        gateway = self.gateway
        origin = request.headers.get("origin")
        cors = {}
        if origin is not None and gateway.options.allowed_origins:
            cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        try:
            if not gateway.rules.origin_allowed(origin, request.headers.get("host")):
                raise HTTPError(403, f"Origin {quoted(origin)} is not allowed (see --allow-origin)",
                                code="origin_not_allowed")
            if request.method == "OPTIONS" and origin is not None:  # a CORS preflight
                asked = request.headers.get("access-control-request-headers", "authorization, content-type")
                return await Response(status_code=204, headers={
                    **cors, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": asked, "Access-Control-Max-Age": "600",
                })(scope, receive, send)
            open_path = request.url.path == "/health" or (request.url.path == "/metrics"
                                                          and gateway.options.public_metrics)
            if not open_path and not gateway.rules.bearer_authorized(request.headers.get("authorization")):
                raise HTTPError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                                code="invalid_api_key")
            await self.app(scope, receive, _with_headers(send, cors))
        except HTTPError as exc:
            await exc.response(cors)(scope, receive, send)
        except ClientError as exc:
            await client_error(exc).response(cors)(scope, receive, send)
        except ClientDisconnect:
            return
        except Exception:
            log.exception("openai_request_failed", path=request.url.path)
            with contextlib.suppress(Exception):  # fails if the response had started
                await HTTPError(500, "the server failed on this request", kind="server_error",
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
