"""What the WebSocket server and the router answer over plain HTTP on their port, and the
access rules every way in shares (the OpenAI frontend applies the same :class:`AccessRules`
through its middleware).

- :class:`AccessRules`: the API key (``Authorization: Bearer <key>``, or from a browser,
  whose WebSocket cannot set headers, the subprotocol ``tokenloom.bearer.<key>``) and the
  browser Origin rule.
- :func:`refuse_upgrade`: the checks a WebSocket upgrade passes, in one order for the
  server and the router: Origin (403), key (401), draining (503), connection cap (503).
- :func:`text_response`, :func:`json_response`: small, closed HTTP answers.
"""

from __future__ import annotations

import hmac
import http
import ipaddress
import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

SUBPROTOCOL, BEARER_SUBPROTOCOL = "tokenloom.v1", "tokenloom.bearer."


def is_loopback(hostname: str | None) -> bool:
    """``localhost``, ``*.localhost`` or a loopback address."""
    if not hostname:
        return False
    if hostname == "localhost" or hostname.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class AccessRules:
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # browser Origins; empty: the loopback rule below

    def authorized(self, token: str | None) -> bool:
        """Is ``token`` the API key (always true when there is none)?"""
        if self.api_key is None:
            return True
        return token is not None and hmac.compare_digest(token.encode(), self.api_key.encode())

    def bearer_authorized(self, authorization: str | None) -> bool:
        """An ``Authorization: Bearer <key>`` header's verdict."""
        auth = authorization or ""
        return self.authorized(auth[7:] if auth.startswith("Bearer ") else None)

    def request_authorized(self, request: Request) -> bool:
        """The bearer header, or a ``tokenloom.bearer.<key>`` subprotocol offered beside
        ``tokenloom.v1`` (a browser's WebSocket)."""
        if self.bearer_authorized(request.headers.get("Authorization")):
            return True
        offered = ",".join(request.headers.get_all("Sec-WebSocket-Protocol"))
        for proto in offered.split(","):
            proto = proto.strip()
            if proto.startswith(BEARER_SUBPROTOCOL) and self.authorized(proto[len(BEARER_SUBPROTOCOL):]):
                return True
        return False

    def origin_allowed(self, origin: str | None, host: str | None) -> bool:
        """Clients that send no Origin (every non-browser client) pass. A browser's Origin
        must be listed when ``--allow-origin`` gives a list. Without one, only a loopback
        page of the server itself passes (Origin and Host both loopback and naming the same
        host:port): no web page a user happens to visit can drive a model served on their
        machine, not even through DNS rebinding, which controls both headers but cannot make
        them name a loopback address."""
        if origin is None:
            return True
        if self.allowed_origins:
            return origin in self.allowed_origins
        parts = urlsplit(origin)
        return host is not None and parts.netloc == host.lower() and is_loopback(parts.hostname)


def select_subprotocol(connection, offered) -> str | None:
    """A browser offers ``tokenloom.v1`` (and its key as a second one); other clients none."""
    return SUBPROTOCOL if SUBPROTOCOL in offered else None


def refuse_upgrade(request: Request, rules: AccessRules, *, authorized: bool, draining: bool,
                   num_connections: int, max_connections: int) -> Response | None:
    """Why a WebSocket upgrade is refused, as the answer to send, or None to accept it."""
    if not rules.origin_allowed(request.headers.get("Origin"), request.headers.get("Host")):
        return text_response(403, "this Origin is not allowed (see --allow-origin)\n")
    if not authorized:
        return text_response(401, "missing or invalid API key\n")
    if draining:
        return text_response(503, "shutting down\n")
    if num_connections >= max_connections:
        return text_response(503, "too many connections\n")
    return None


def text_response(status: int, body: str, content_type: str = "text/plain; charset=utf-8",
                  extra_headers: list[tuple[str, str]] | None = None) -> Response:
    return bytes_response(status, body.encode(), content_type, extra_headers)


def json_response(status: int, body: dict) -> Response:
    return text_response(status, json.dumps(body), "application/json")


def bytes_response(status: int, data: bytes, content_type: str,
                   extra_headers: list[tuple[str, str]] | None = None) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(data))),
                       *(extra_headers or []), ("Connection", "close")])
    return Response(status, http.HTTPStatus(status).phrase, headers, data)
