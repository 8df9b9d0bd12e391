"""One HTTP connection of the OpenAI frontend: uvicorn's h11 protocol with read deadlines,
counted in the gateway's connection limits.

uvicorn closes a connection idle between requests after its keep-alive timeout, and
nothing else: a client that connects and sends nothing, or half a request head, or half
a body, would hold its connection (and a file descriptor) for ever. Here each phase of
reading a request has a deadline:

- head: a new connection's request head must be complete within ``header_timeout_s`` of
  the connection opening; a later request's within ``header_timeout_s`` of its first
  byte (before that first byte, the keep-alive timeout runs);
- body: the body must be complete within ``body_timeout_s`` of the head;
- keep-alive: between requests, uvicorn's ``timeout_keep_alive``.

A request still being sent when its deadline passes is answered ``408 Request Timeout``
(a connection that sent nothing is just closed); each timeout is counted in
``tokenloom_connection_timeouts_total{frontend="openai", phase}``. Once a request has
been read no deadline runs: answering it may take minutes (``--send-timeout`` bounds a
stalled stream).
"""

from __future__ import annotations

import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenloom.protocols.connections import counted

_408 = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 33\r\n"
        b"Connection: close\r\n\r\nthe request was not sent in time\n")


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the head and body deadlines above. The subclass made by
    :func:`http_protocol` sets ``header_timeout_s``, ``body_timeout_s`` and ``metrics``."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    metrics = None
    _phase: str | None = None
    _deadline = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._sync_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._sync_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._sync_deadline()

    def connection_lost(self, exc) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    def timeout_keep_alive_handler(self) -> None:
        self._count("keepalive")
        super().timeout_keep_alive_handler()

    # ---- deadlines ---------------------------------------------------------------------
    def _sync_deadline(self) -> None:
        """The phase the connection is in now: reading a head, reading a body, or neither
        (the request is being answered, or the keep-alive timer runs)."""
        if self.transport is None or self.transport.is_closing():
            phase = None
        elif self.conn.their_state is h11.SEND_BODY:
            phase = "body"
        elif self.conn.their_state is h11.IDLE and self.timeout_keep_alive_task is None:
            phase = "head"
        else:
            phase = None
        self._set_phase(phase)

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return  # a deadline runs from the phase's start, not from the latest bytes
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            timeout = self.header_timeout_s if phase == "head" else self.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._timed_out)

    def _timed_out(self) -> None:
        phase, self._deadline, self._phase = self._phase, None, None
        if self.transport.is_closing():
            return
        if phase == "head":
            started = bool(self.conn.trailing_data[0])
        else:
            started = self.cycle is not None and not self.cycle.response_started
        self._count(("header" if started else "idle") if phase == "head" else "body")
        if started:  # a half-sent request hears why it was cut (nothing answered it yet)
            self.transport.write(_408)
        self.transport.close()

    def _count(self, phase: str) -> None:
        if self.metrics is not None:
            self.metrics.connection_timeouts.labels(frontend="openai", phase=phase).inc()


def http_protocol(gateway) -> type:
    """The protocol class uvicorn builds per connection (``Config(http=...)``): read
    deadlines from the gateway's options, counted in its connection limits."""
    o = gateway.options
    return counted(TimedH11Protocol, gateway.connections, "openai", header_timeout_s=o.http_header_timeout_s,
                   body_timeout_s=o.http_body_timeout_s, metrics=gateway.metrics)


class QuietProtocolErrors(logging.Filter):
    """uvicorn logs a warning for every request that is not HTTP and every upgrade it does
    not serve: a line per attacker's request. Count them instead."""

    MESSAGES = {"Invalid HTTP request received.": "invalid_request",
                "Unsupported upgrade request.": "unsupported_upgrade"}

    def __init__(self, metrics):
        super().__init__()
        self.metrics = metrics

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        kind = self.MESSAGES.get(message)
        if kind is not None:
            self.metrics.http_protocol_errors.labels(kind=kind).inc()
            return False
        return not message.startswith("No supported WebSocket library detected")
