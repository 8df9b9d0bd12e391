"""Python client for the WebSocket protocol: many concurrent requests on one connection.

    async with Client("ws://127.0.0.1:8765") as client:
        async for event in client.generate("Hello", params={"max_tokens": 32}):
            if isinstance(event, Delta):
                print(event.text, end="")
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.protocols.websocket.messages import (
    Accepted,
    Cancel,
    ChatMessage,
    Delta,
    Done,
    Error,
    Generate,
    Ping,
    Pong,
    Session,
    decode_server,
    encode,
)


class RequestError(Exception):
    """The server refused a request: ``code`` (stable), ``param`` (when one is to blame)."""

    def __init__(self, err: Error):
        super().__init__(f"{err.code}: {err.message}")
        self.code, self.param, self.retry_after_ms, self.error = err.code, err.param, err.retry_after_ms, err


class Client:
    def __init__(self, url: str, *, api_key: str | None = None, origin: str | None = None,
                 max_size: int = 1 << 24):
        self.url, self.api_key, self.origin, self.max_size = url, api_key, origin, max_size
        self.session: Session | None = None
        self.errors: asyncio.Queue = asyncio.Queue()  # errors not tied to a request
        self._queues: dict[str, asyncio.Queue] = {}
        self._pongs: asyncio.Queue = asyncio.Queue()
        self._ids = itertools.count(1)
        self.accepted: set[str] = set()  # ids the server accepted (each owes exactly one `done`)
        self._ws = None
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self._ws = await connect(self.url, additional_headers=headers, origin=self.origin, max_size=self.max_size)
        first = decode_server(await self._ws.recv())
        if not isinstance(first, Session):
            raise RuntimeError(f"expected a session message, got {type(first).__name__}")
        self.session = first
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self) -> None:
        try:
            async for frame in self._ws:
                msg = decode_server(frame)
                if isinstance(msg, Pong):
                    self._pongs.put_nowait(msg)
                    continue
                rid = getattr(msg, "id", None)
                queue = self._queues.get(rid) if rid is not None else None
                (queue or self.errors).put_nowait(msg)
        except ConnectionClosed:
            pass
        finally:
            for q in self._queues.values():
                q.put_nowait(None)

    async def send_raw(self, text: str | bytes) -> None:
        """Send a frame as is (tests use it for malformed input)."""
        await self._ws.send(text)

    async def ping(self, data: str | None = None) -> Pong:
        await self._ws.send(encode(Ping(data=data)))
        return await self._pongs.get()

    async def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                       params: SamplingParams | dict[str, Any] | None = None,
                       id: str | None = None, cache_salt: str | None = None,
                       parse_special_tokens: bool | None = None) -> AsyncIterator[Delta | Done]:
        """Yield deltas, then the one ``done``. Raises :class:`RequestError` if refused.
        ``parse_special_tokens``: see :class:`~tokenloom.protocols.websocket.messages.Generate`."""
        rid = id or f"r{next(self._ids)}"
        if isinstance(params, dict):
            params = msgspec.convert(params, SamplingParams)
        msg = Generate(id=rid, params=params or SamplingParams(), cache_salt=cache_salt,
                       parse_special_tokens=parse_special_tokens,
                       prompt=prompt if isinstance(prompt, str) else None,
                       prompt_token_ids=prompt if isinstance(prompt, list) else None,
                       messages=[ChatMessage(role=m["role"], content=m["content"]) for m in messages]
                       if messages is not None else None)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        try:
            await self._ws.send(encode(msg))
            while True:
                item = await queue.get()
                if item is None:
                    raise ConnectionError("connection closed before the request finished")
                if isinstance(item, Error):
                    raise RequestError(item)
                if isinstance(item, Accepted):
                    self.accepted.add(rid)
                    continue
                yield item
                if isinstance(item, Done):
                    return
        finally:
            self._queues.pop(rid, None)

    async def cancel(self, rid: str) -> None:
        await self._ws.send(encode(Cancel(id=rid)))
