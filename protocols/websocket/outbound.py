"""A per-connection outbound queue that coalesces deltas instead of dropping them.

A client that reads slowly makes deltas pile up; rather than growing a list of frames,
each request keeps at most one pending ``delta`` (later text and token ids are appended
to it), so memory grows with the text generated, not the number of steps, and nothing
is ever lost. ``pending_bytes`` estimates what is held (text, ids, logprobs) so the
connection can bound the bytes a non-reading client makes the server keep: past its
limit the connection is cut, as after a send timeout. Control messages (accepted, done, error, pong) keep their order relative
to a request's delta: a pending delta is flushed before that request's ``done``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable

from websockets.exceptions import ConnectionClosed

from tokenloom.protocols.websocket.messages import Delta, LogprobOut, encode

# Rough JSON sizes, enough to bound memory: a token id, a logprob entry, a control message.
_ID_BYTES, _LOGPROB_BYTES, _MSG_BYTES = 8, 32, 256


def _delta_bytes(text: str, token_ids: list[int], logprobs: list[LogprobOut] | None) -> int:
    n = len(text) + _ID_BYTES * len(token_ids)
    if logprobs:
        n += sum(_LOGPROB_BYTES * (1 + len(lp.top)) for lp in logprobs)
    return n


class OutboundQueue:
    def __init__(self) -> None:
        self._items: deque = deque()  # ("msg", message) or ("delta", request_id)
        self._deltas: OrderedDict[str, dict] = OrderedDict()
        self._ready = asyncio.Event()
        self.closed = False
        self.coalesced = 0  # deltas merged into an earlier pending one
        self.pending_bytes = 0
        self.peak_pending_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, msg) -> None:
        if self.closed:
            return
        self._items.append(("msg", msg))
        self._grow(_MSG_BYTES)
        self._ready.set()

    def _grow(self, n: int) -> None:
        self.pending_bytes += n
        self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)

    def put_delta(self, rid: str, text: str, token_ids: list[int], logprobs: list[LogprobOut] | None) -> None:
        if self.closed:
            return
        self._grow(_delta_bytes(text, token_ids, logprobs))
        pending = self._deltas.get(rid)
        if pending is None:
            self._deltas[rid] = {"text": [text], "token_ids": list(token_ids),
                                 "logprobs": list(logprobs) if logprobs is not None else None}
            self._items.append(("delta", rid))
            self._ready.set()
            return
        self.coalesced += 1
        pending["text"].append(text)
        pending["token_ids"].extend(token_ids)
        if logprobs is not None:
            pending["logprobs"] = (pending["logprobs"] or []) + list(logprobs)

    async def get(self):
        while not self._items:
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        kind, value = self._items.popleft()
        if kind == "msg":
            self.pending_bytes -= _MSG_BYTES
            return value
        d = self._deltas.pop(value)
        delta = Delta(id=value, text="".join(d["text"]), token_ids=d["token_ids"], logprobs=d["logprobs"])
        self.pending_bytes -= _delta_bytes(delta.text, delta.token_ids, delta.logprobs)
        return delta

    def close(self) -> None:
        self.closed = True
        self._ready.set()


async def send_queued(ws, out: OutboundQueue, timeout_s: float, on_timeout: Callable[[], None]) -> None:
    """Send ``out``'s messages on ``ws`` until the queue closes or the peer goes; a send
    blocked longer than ``timeout_s`` (the peer stopped reading) calls ``on_timeout``."""
    while True:
        msg = await out.get()
        if msg is None:
            return
        try:
            await asyncio.wait_for(ws.send(encode(msg)), timeout_s)
        except TimeoutError:
            on_timeout()
            return
        except ConnectionClosed:
            return


async def drain(out: OutboundQueue, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until what is queued has been sent."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while len(out) and loop.time() < end and not out.closed:
        await asyncio.sleep(0.01)
