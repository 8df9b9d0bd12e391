"""One accepted request's answer: a whole ``chat.completion`` / ``text_completion``, or
server-sent events. However the answer ends (finished, the client hung up, a send stalled,
the server closed), the request is aborted if it still runs and its end is counted once."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokenloom.core.outputs import Finished
from tokenloom.protocols.openai import schema
from tokenloom.protocols.openai.rules import HTTPError


class Answer:
    def __init__(self, frontend, req, kind: str, state):
        self.frontend, self.req, self.kind, self.state = frontend, req, kind, state
        self.engine, self.metrics = frontend.engine, frontend.gateway.metrics
        self.rid = state.request_id
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + self.rid.removeprefix("oai-")
        self.created = int(time.time())
        self.finished = False  # its final result was seen (and counted)
        frontend.active.add(self.rid)

    # ---- shapes ---------------------------------------------------------------------------
    def _logprobs(self, entries, text: str, offset: int):
        if not entries:
            return None
        tokenizer = self.engine.tokenizer
        if self.kind == "chat.completion":
            return schema.chat_logprobs(tokenizer, entries)
        return schema.completion_logprobs(tokenizer, entries, offset, len(text))

    def _choice(self, text: str, logprobs, reason: str | None, *, stream: bool) -> dict:
        if self.kind == "text_completion":
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if not stream:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": reason}
        delta = {} if reason is not None else {"content": text}  # the finish chunk's delta is empty
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _envelope(self, choices: list, *, stream: bool, **extra) -> dict:
        obj = self.kind + (".chunk" if stream and self.kind == "chat.completion" else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.frontend.model,
                "choices": choices, **extra}

    # ---- the two ways to answer -------------------------------------------------------------
    async def whole(self, request: Request) -> Response:
        """Collect the answer, watching for the client hanging up (that aborts it)."""
        collect = asyncio.ensure_future(_collect(self.engine.stream(self.state)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([collect, gone], return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():  # the client left: abort; the stream still ends with Finished
                self.engine.abort(self.rid)
            final, entries = await collect
            self._finished(final)  # before close(): its final result is consumed
        finally:
            gone.cancel()
            collect.cancel()
            self.close()
        if final.finish_reason == "error":  # 503, not 500: the engine restarts; retrying is right
            raise HTTPError(503, f"the engine failed on this request: {final.error}", kind="server_error",
                            code="engine_error", retry_after_ms=self.engine.health_report().retry_after_ms)
        choice = self._choice(final.text, self._logprobs(entries, final.text, 0),
                              schema.finish_reason(final.finish_reason), stream=False)
        return schema.json_response(self._envelope([choice], stream=False, usage=schema.usage_body(final.usage)))

    def events_response(self, include_usage: bool, send_timeout_s: float) -> Response:
        return _EventStream(self._events(include_usage), self.close, send_timeout_s)

    async def _events(self, include_usage: bool):
        """A role chunk (chat), content chunks, the finish chunk, the usage chunk when asked,
        then ``[DONE]``; an engine failure is an ``error`` event. What the engine has ready
        at once (deltas that piled up, the last delta and the end) goes out in one write."""
        usage_none = {"usage": None} if include_usage else {}
        offset = 0
        if self.kind == "chat.completion":
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
            yield _sse(self._envelope([first], stream=True, **usage_none))
        async for ready in self.engine.stream(self.state, batched=True):
            frames = []
            for item in ready:
                if isinstance(item, Finished):
                    self._finished(item)
                    if item.finish_reason == "error":
                        frames.append(_sse(schema.error_body(f"the engine failed on this request: {item.error}",
                                                             kind="server_error", code="engine_error")))
                    else:
                        finish = self._choice("", None, schema.finish_reason(item.finish_reason), stream=True)
                        frames.append(_sse(self._envelope([finish], stream=True, **usage_none)))
                        if include_usage:
                            frames.append(_sse(self._envelope([], stream=True, usage=schema.usage_body(item.usage))))
                    frames.append(b"data: [DONE]\n\n")
                elif item.text or item.logprobs:
                    logprobs = self._logprobs(item.logprobs, item.text, offset)
                    offset += len(item.text)
                    frames.append(_sse(self._envelope([self._choice(item.text, logprobs, None, stream=True)],
                                                      stream=True, **usage_none)))
            if frames:
                yield b"".join(frames)

    # ---- the end --------------------------------------------------------------------------
    def _finished(self, final: Finished) -> None:
        if not self.finished:
            self.finished = True
            self.metrics.observe_finished(final.finish_reason, final)

    def close(self) -> None:
        """The answer is over: abort the request if it still runs (the client left), and
        count its end once the engine has ended it. Whether or not this abort is the one
        that ends it (leaving the engine's stream aborts too, and the engine may have ended
        it meanwhile), its final result has not been consumed yet, so it is awaited here."""
        self.frontend.active.discard(self.rid)
        if not self.finished:
            self.engine.abort(self.rid)
            task = asyncio.ensure_future(self._count_abort())
            self.frontend.background.add(task)
            task.add_done_callback(self.frontend.background.discard)

    async def _count_abort(self) -> None:
        async for item in self.engine.stream(self.state):
            if isinstance(item, Finished):
                self._finished(item)


class _EventStream(StreamingResponse):
    """Server-sent events that end their request however the response ends (the client hung
    up mid-stream or before the first event, a send stalled past ``send_timeout_s`` because
    the client stopped reading, the server is closing)."""

    def __init__(self, events, on_close, send_timeout_s: float):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close, self._send_timeout_s = on_close, send_timeout_s

    async def __call__(self, scope, receive, send):
        async def timed_send(message):
            await asyncio.wait_for(send(message), self._send_timeout_s)

        try:
            await super().__call__(scope, receive, timed_send)
        except Exception as exc:
            if not _only_timeouts(exc):
                raise
            # the client stopped reading: its request ends here (uvicorn drops the connection)
        finally:
            await self.body_iterator.aclose()
            self._on_close()


def _only_timeouts(exc: BaseException) -> bool:
    """A TimeoutError, or an exception group (from Starlette's task group) of nothing else."""
    if isinstance(exc, TimeoutError):
        return True
    inner = getattr(exc, "exceptions", None)
    return bool(inner) and all(_only_timeouts(e) for e in inner)


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
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: dict) -> bytes:
    return b"data: " + schema.encode(body) + b"\n\n"
