"""One replica behind the router: a pooled WebSocket connection to its `tokenloom serve`,
the router's requests in flight there, and its health.

Every client connection of the router shares the replica's one upstream connection, so
each request goes up under an id of the router's own (``r1``, ``r2``, ...) and the
replies are mapped back to the client's id. The reader never awaits a client: replies go
into the client's coalescing :class:`~tokenloom.protocols.websocket.outbound.OutboundQueue`, so a
slow client cannot stall the others. When the connection drops, every request in flight
there ends at once: an ``error`` if the replica had not accepted it, else a final ``done``
with finish reason ``error`` naming the replica.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from tokenloom.core.outputs import Usage
from tokenloom.protocols.router.policy import PrefixIndex, block_hashes, continued_text
from tokenloom.protocols.websocket.messages import (
    Accepted,
    Cancel,
    Delta,
    Done,
    Error,
    Generate,
    MetricsOut,
    Session,
    decode_server,
    encode,
)
from tokenloom.protocols.websocket.outbound import OutboundQueue

log = structlog.get_logger("tokenloom.router")


class ReplicaDown(Exception):
    """The replica cannot take the request now (not connected, or the send failed)."""


class ClientSide(Protocol):
    out: OutboundQueue

    def finished(self, rid: str) -> None: ...


@dataclass(slots=True)
class Pending:
    """One client request relayed through a replica."""

    client: ClientSide
    rid: str  # the client's id
    msg: Generate
    accepted: bool = False
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    replica: Replica | None = None
    uid: str | None = None  # the id upstream
    cancelled: bool = False  # cancel asked before the request reached the replica


class Replica:
    def __init__(self, url: str, *, api_key: str | None = None, index: PrefixIndex | None = None,
                 open_timeout_s: float = 5.0, max_frame_bytes: int = 1 << 24):
        self.url = url.rstrip("/")
        self.http_url = "http" + self.url[2:]  # ws://h:p -> http://h:p, wss -> https
        self.api_key, self.open_timeout_s, self.max_frame_bytes = api_key, open_timeout_s, max_frame_bytes
        self.index = index or PrefixIndex()
        self.state, self.reason = "down", "not connected yet"  # up | unhealthy | down
        self.session: Session | None = None
        self.pending: dict[str, Pending] = {}  # upstream id -> request
        self.routed = {"cache": 0, "load": 0}
        self.failed = 0  # requests ended by this replica's loss
        self._ws: ClientConnection | None = None
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._reader: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        return len(self.pending)

    def _headers(self) -> dict[str, str] | None:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None

    async def connect(self) -> None:
        """Open the pooled connection (once) and read its session; raises ReplicaDown."""
        async with self._lock:
            if self._ws is not None:
                return
            try:
                ws = await connect(self.url, additional_headers=self._headers(), max_size=self.max_frame_bytes,
                                   open_timeout=self.open_timeout_s, ping_interval=5, ping_timeout=10)
                first = decode_server(await asyncio.wait_for(ws.recv(), self.open_timeout_s))
            except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed, msgspec.DecodeError) as exc:
                self._mark("down", f"cannot connect: {exc}")
                raise ReplicaDown(self.reason) from None
            if not isinstance(first, Session):
                await ws.close()
                self._mark("down", f"expected a session message, got {type(first).__name__}")
                raise ReplicaDown(self.reason)
            self.session, self._ws = first, ws
            self._mark("up", None)
            self._reader = asyncio.create_task(self._read(ws))

    def _mark(self, state: str, reason: str | None) -> None:
        if state != self.state:
            log.info("replica_state", replica=self.url, state=state, reason=reason)
        self.state, self.reason = state, reason

    async def submit(self, p: Pending) -> None:
        """Send ``p`` upstream under a fresh id. ReplicaDown if it did not leave (the caller
        may try another replica); a request the replica's loss has already answered returns."""
        ws = self._ws
        if ws is None:
            raise ReplicaDown(self.reason or "not connected")
        uid = f"r{next(self._ids)}"
        p.replica, p.uid = self, uid
        self.pending[uid] = p
        try:
            await ws.send(encode(msgspec.structs.replace(p.msg, id=uid)))
        except ConnectionClosed:
            if self.pending.pop(uid, None) is not None:
                raise ReplicaDown("connection lost while sending") from None
            return
        if p.cancelled:
            await self.cancel(uid)

    async def cancel(self, uid: str) -> None:
        ws = self._ws
        if ws is not None and uid in self.pending:
            try:
                await ws.send(encode(Cancel(id=uid)))
            except ConnectionClosed:
                pass  # the reader ends the request

    async def _read(self, ws: ClientConnection) -> None:
        reason = "connection closed"
        try:
            async for frame in ws:
                try:
                    self._relay(decode_server(frame))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    log.warning("replica_bad_frame", replica=self.url)
        except ConnectionClosed as exc:
            reason = f"connection lost ({exc})"
        except Exception as exc:  # never leave requests hanging, whatever broke
            log.exception("replica_reader_failed", replica=self.url)
            reason = f"reader failed ({exc})"
        finally:
            if self._ws is ws:
                self._ws = None
            self._mark("down", reason)
            self.fail_all(reason)

    def _relay(self, msg) -> None:
        rid = getattr(msg, "id", None)
        p = self.pending.get(rid) if rid is not None else None
        if p is None:  # session, pong, a frame-level error, or a request already ended
            if isinstance(msg, Error):
                log.warning("replica_error", replica=self.url, code=msg.code, message=msg.message)
            return
        out = p.client.out
        if isinstance(msg, Delta):
            p.text.append(msg.text)
            p.token_ids.extend(msg.token_ids)
            out.put_delta(p.rid, msg.text, msg.token_ids, msg.logprobs)
        elif isinstance(msg, Accepted):
            p.accepted = True
            out.put(Accepted(id=p.rid))
        elif isinstance(msg, Done):
            self._finish(rid, p, msgspec.structs.replace(msg, id=p.rid))
            if msg.finish_reason in ("stop", "length"):  # what the replica's cache now holds
                self.index.insert(block_hashes(continued_text(p.msg, "".join(p.text), p.token_ids),
                                               self.index.block_chars))
        elif isinstance(msg, Error):
            if p.accepted:  # e.g. a late cancel's unknown_id: the request still ends with its done
                out.put(msgspec.structs.replace(msg, id=p.rid))
            else:
                self._finish(rid, p, msgspec.structs.replace(msg, id=p.rid))

    def _finish(self, uid: str, p: Pending, final: Done | Error) -> None:
        self.pending.pop(uid, None)
        p.client.out.put(final)
        p.client.finished(p.rid)

    def fail_all(self, reason: str) -> None:
        """End every request in flight here: the replica is gone."""
        for uid, p in list(self.pending.items()):
            self.failed += 1
            message = f"replica {self.url} failed: {reason}"
            if p.accepted:
                final = Done(id=p.rid, finish_reason="error", error=message,
                             usage=Usage(prompt_tokens=0, cached_tokens=0, completion_tokens=len(p.token_ids)),
                             metrics=MetricsOut(ttft_ms=None, tpot_ms=None, e2e_ms=0.0))
            else:
                final = Error(code="engine_unavailable", id=p.rid, retry_after_ms=1000,
                              message=message + "; retry the request")
            self._finish(uid, p, final)

    # ---- health -------------------------------------------------------------------------
    async def probe(self, timeout_s: float = 2.0) -> None:
        """Poll ``/health``: reconnect a replica that answers ok again; stop routing to one
        that answers anything else (draining, restarting), while its requests carry on."""
        status, body = await asyncio.to_thread(http_get, self.http_url + "/health", self.api_key, timeout_s)
        if status == 200:
            if self._ws is None:
                try:
                    await self.connect()
                except ReplicaDown:
                    pass
            else:
                self._mark("up", None)
        elif status is None:
            if self._ws is not None:
                self._mark("unhealthy", f"/health unreachable: {body}")
        else:
            self._mark("unhealthy" if self._ws is not None else "down", f"/health answered {status}: {body[:200]}")

    async def fetch_stats(self, timeout_s: float = 2.0) -> dict | None:
        status, body = await asyncio.to_thread(http_get, self.http_url + "/stats", self.api_key, timeout_s)
        try:
            return json.loads(body) if status == 200 else None
        except ValueError:
            return None

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


def http_get(url: str, api_key: str | None, timeout_s: float) -> tuple[int | None, str]:
    """A blocking GET (run it in a thread): (status, body), or (None, why) if unreachable."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        return None, str(exc)
