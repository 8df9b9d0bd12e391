"""One client connection of the router: the same protocol as `tokenloom serve` speaks.

Frames are decoded and refused exactly as the server does (messages.py); each accepted
``generate`` is handed to the router, which picks a replica and relays the replica's
``accepted``/``delta``/``done``/``error`` for it back here under the client's own id.
``ping`` is answered here. A disconnect cancels every request of the connection upstream.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from tokenloom.protocols.router.upstream import Pending
from tokenloom.protocols.websocket.messages import (
    Error,
    Generate,
    Session,
    dispatch_client_frame,
)
from tokenloom.protocols.websocket.outbound import OutboundQueue, drain, send_queued

if TYPE_CHECKING:
    from tokenloom.protocols.router.server import Router

log = structlog.get_logger("tokenloom.router")


class ClientConnection:
    def __init__(self, router: Router, ws: ServerConnection, session: Session):
        self.router, self.ws = router, ws
        self.out = OutboundQueue()
        self.out.put(session)
        self.requests: dict[str, Pending] = {}  # client id -> request, until its done/error
        self._tasks: set[asyncio.Task] = set()

    def finished(self, rid: str) -> None:
        self.requests.pop(rid, None)

    async def run(self) -> None:
        writer = asyncio.create_task(self._writer())
        try:
            async for frame in self.ws:
                self._on_frame(frame)
        except ConnectionClosed:
            pass
        finally:
            self.out.close()
            self.cancel_all()
            writer.cancel()

    def _on_frame(self, frame: str | bytes) -> None:
        dispatch_client_frame(frame, self.out.put, self._generate, self._cancel)

    def _generate(self, msg: Generate) -> None:
        rid = msg.id
        if rid in self.requests:
            self.out.put(Error(code="duplicate_id", id=rid, param="id", message=f"request {rid!r} is already running"))
            return
        if len(self.requests) >= self.router.options.max_requests_per_connection:
            self.out.put(Error(code="too_many_requests", id=rid, message="too many requests on this connection"))
            return
        if self.router.draining:
            self.out.put(Error(code="shutting_down", id=rid, message="the router is shutting down"))
            return
        p = self.requests[rid] = Pending(client=self, rid=rid, msg=msg)
        self._spawn(self.router.dispatch(p))

    def _cancel(self, rid: str) -> None:
        p = self.requests.get(rid)
        if p is None:
            self.out.put(Error(code="unknown_id", id=rid, param="id", message=f"no running request {rid!r}"))
            return
        self._cancel_upstream(p)

    def _cancel_upstream(self, p: Pending) -> None:
        p.cancelled = True  # if it has not left yet, submit() cancels it once sent
        if p.replica is not None and p.uid is not None:
            self._spawn(p.replica.cancel(p.uid))

    def cancel_all(self) -> None:
        for p in list(self.requests.values()):
            self._cancel_upstream(p)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _writer(self) -> None:
        await send_queued(self.ws, self.out, self.router.options.send_timeout_s, self._cut)

    def _cut(self) -> None:
        """The client stopped reading: end its requests, drop it (then log)."""
        pending = len(self.out)
        self.out.close()
        self.cancel_all()
        self.ws.transport.abort()
        log.warning("send_timeout", seconds=self.router.options.send_timeout_s, pending=pending)

    async def drain_and_close(self, code: int, reason: str) -> None:
        """Send what is queued (the final `done`s), then close."""
        await drain(self.out, self.router.options.send_timeout_s)
        await self.ws.close(code, reason)
