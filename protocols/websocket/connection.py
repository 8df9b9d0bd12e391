"""One WebSocket connection of `tokenloom serve`: its frames, its requests, its outbound queue.

Each ``generate`` becomes a task that tokenises off the event loop, charges the
connection's rate limit, submits to the engine and streams deltas into the coalescing
outbound queue; one writer task sends that queue. A disconnect, a send timeout or too
many unsent bytes abort every request of the connection.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from tokenloom.core.errors import ClientError, EngineUnavailable
from tokenloom.core.outputs import Finished, Usage
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.protocols.gateway import RateLimited, Refused
from tokenloom.protocols.ratelimit import RateLimiter
from tokenloom.protocols.websocket.messages import (
    PROTOCOL_VERSION,
    Accepted,
    Done,
    Error,
    Generate,
    Limits,
    LogprobOut,
    MetricsOut,
    Session,
    dispatch_client_frame,
)
from tokenloom.protocols.websocket.outbound import OutboundQueue, drain, send_queued

if TYPE_CHECKING:
    from tokenloom.protocols.websocket.server import TokenServer

log = structlog.get_logger("tokenloom.server")


class Connection:
    def __init__(self, server: TokenServer, ws: ServerConnection, conn_id: int):
        self.server, self.ws, self.conn_id = server, ws, conn_id
        self.engine, self.gateway = server.engine, server.gateway
        self.out = OutboundQueue()
        self.tasks: dict[str, asyncio.Task] = {}  # client id -> admission + streaming task
        self.cancelled: set[str] = set()
        self.closing = False  # set once every request of this connection is being aborted
        self.limiter = RateLimiter(server.options.rate_limits)
        self.log = log.bind(conn=conn_id)

    def _engine_id(self, rid: str) -> str:
        return f"c{self.conn_id}:{rid}"

    async def run(self) -> None:
        e, o = self.engine, self.server.options
        self.out.put(Session(protocol=PROTOCOL_VERSION, model=e.model_name,
                             limits=Limits(max_model_len=e.max_model_len, max_frame_bytes=o.max_frame_bytes,
                                           max_queue=o.max_queue,
                                           max_tokens_default=SamplingParams().max_tokens),
                             strategies=e.config.to_dict()))
        writer = asyncio.create_task(self._writer())
        try:
            async for frame in self.ws:
                self._on_frame(frame)
        except ConnectionClosed:
            pass
        finally:
            self.abort_all()  # a disconnect aborts every request of this connection
            self.out.close()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            writer.cancel()

    def _on_frame(self, frame: str | bytes) -> None:
        """Whatever a frame holds, it gets an answer and the connection carries on."""
        try:
            self._dispatch(frame)
        except Exception:
            self.log.exception("frame_failed")
            self.out.put(Error(code="internal_error", message="the server failed to handle this frame"))

    def _dispatch(self, frame: str | bytes) -> None:
        dispatch_client_frame(frame, self.out.put, self._generate, self._cancel)

    def _generate(self, msg: Generate) -> None:
        o, rid = self.server.options, msg.id
        if rid in self.tasks:
            self.out.put(Error(code="duplicate_id", id=rid, param="id", message=f"request {rid!r} is already running"))
            return
        if len(self.tasks) >= o.max_requests_per_connection:
            self.out.put(Error(code="too_many_requests", id=rid, message="too many requests on this connection"))
            return
        try:
            self.gateway.reserve()  # now, before the next frame: a burst cannot overshoot max_queue
        except Refused as exc:
            self._refused(rid, exc)
            return
        try:
            self.gateway.take_request(self.limiter)
        except RateLimited as exc:
            self.gateway.release()
            self._rate_limited(rid, exc)
            return
        self.tasks[rid] = asyncio.create_task(self._serve(rid, msg))  # admit() gives the slot back

    def _refused(self, rid: str, exc: Refused) -> None:
        r = exc.refusal
        self.out.put(Error(code=r.code, id=rid, retry_after_ms=r.retry_after_ms, message=r.message))

    def _rate_limited(self, rid: str, exc: RateLimited) -> None:
        self.out.put(Error(code="rate_limited", id=rid, retry_after_ms=exc.wait_ms,
                           message=f"this connection is over its {exc.what} per minute; retry in {exc.wait_ms} ms"))

    async def _serve(self, rid: str, msg: Generate) -> None:
        """One request: admission, then its stream. Whatever fails, the client hears of it:
        an ``error`` before acceptance, exactly one ``done`` after."""
        accepted = finished = False
        try:
            req = await self._admit(rid, msg)
            if req is None:
                return
            self.out.put(Accepted(id=rid))
            accepted = True
            if rid in self.cancelled or self.closing:  # cancelled or disconnected while tokenising
                self.engine.abort(self._engine_id(rid))
            finished = await self._stream(rid, req)
        except Exception:
            self.log.exception("request_failed", id=rid)
            if not accepted:
                self.out.put(Error(code="internal_error", id=rid, message="the server failed to admit this request"))
            elif not finished:
                self.engine.abort(self._engine_id(rid))
                self.out.put(Done(id=rid, finish_reason="error", error="internal error",
                                  usage=Usage(prompt_tokens=0, cached_tokens=0, completion_tokens=0),
                                  metrics=MetricsOut(ttft_ms=None, tpot_ms=None, e2e_ms=0.0)))
        finally:
            self.tasks.pop(rid, None)
            self.cancelled.discard(rid)

    async def _admit(self, rid: str, msg: Generate):
        """Tokenise off the loop, charge the rate limit, submit; None (and an error sent) if refused."""
        try:
            if (refusal := _not_on_websocket(msg.params)) is not None:
                self.gateway.release()  # the slot _generate reserved (admit would give it back)
                raise refusal
            messages = [{"role": m.role, "content": m.content} for m in msg.messages] if msg.messages else None
            prompt = msg.prompt if msg.prompt is not None else msg.prompt_token_ids
            return await self.gateway.admit(params=msg.params, limiter=self.limiter, request_id=self._engine_id(rid),
                                            prompt=prompt, messages=messages, reserved=True,
                                            parse_special_tokens=msg.parse_special_tokens, cache_salt=msg.cache_salt)
        except Refused as exc:
            self._refused(rid, exc)
        except RateLimited as exc:
            self._rate_limited(rid, exc)
        except EngineUnavailable as exc:
            self.out.put(Error(code=exc.code, id=rid, retry_after_ms=exc.retry_after_ms, message=str(exc)))
        except ClientError as exc:
            self.out.put(Error(code=exc.code, id=rid, param=exc.param, message=str(exc)))
        return None

    async def _stream(self, rid: str, req) -> bool:
        """Forward the engine's stream; True once the ``done`` is queued."""
        limit = self.server.options.max_pending_bytes
        async for item in self.engine.stream(req):
            if isinstance(item, Finished):
                self._done(rid, item)
                return True
            lps = None
            if item.logprobs:
                lps = [LogprobOut(token_id=lp.token_id, logprob=lp.logprob,
                                  top=[(t.token_id, t.logprob) for t in lp.top]) for lp in item.logprobs]
            self.out.put_delta(rid, item.text, item.token_ids, lps)
            if self.out.pending_bytes > limit and not self.out.closed:
                self._cut("outbound_overflow", pending_bytes=self.out.pending_bytes, limit=limit)
        return False

    def _done(self, rid: str, f: Finished) -> None:
        reason = "cancelled" if f.finish_reason == "aborted" and rid in self.cancelled else f.finish_reason
        self.server.metrics.observe_finished(reason, f)
        m = f.metrics
        self.out.put(Done(id=rid, finish_reason=reason, usage=f.usage,
                          metrics=MetricsOut(ttft_ms=m.ttft_ms, tpot_ms=m.tpot_ms, e2e_ms=m.e2e_ms,
                                             num_draft_tokens=m.num_draft_tokens,
                                             num_accepted_tokens=m.num_accepted_tokens,
                                             drafted_by=m.drafted_by),
                          error=f.error))

    def _cancel(self, rid: str) -> None:
        if rid not in self.tasks:
            self.out.put(Error(code="unknown_id", id=rid, param="id", message=f"no running request {rid!r}"))
            return
        self.cancelled.add(rid)
        self.engine.abort(self._engine_id(rid))

    def abort_all(self) -> None:
        self.closing = True
        for rid in list(self.tasks):
            self.engine.abort(self._engine_id(rid))

    def _cut(self, event: str, **details) -> None:
        """The peer is not reading: abort its requests and drop the transport (then log:
        nothing after a failed log call may be left undone)."""
        self.abort_all()
        self.out.close()
        self.ws.transport.abort()
        self.log.warning(event, **details)

    async def _writer(self) -> None:
        timeout = self.server.options.send_timeout_s
        await send_queued(self.ws, self.out, timeout,
                          lambda: self._cut("send_timeout", seconds=timeout, pending=len(self.out)))

    async def drain_and_close(self, code: int, reason: str) -> None:
        """Send what is queued (the final `done`s), then close."""
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await drain(self.out, self.server.options.send_timeout_s)
        await self.ws.close(code, reason)


def _not_on_websocket(params: SamplingParams) -> ClientError | None:
    """What the protocol's one stream per request cannot carry: ``n`` > 1 samples (send n
    requests: a shared prompt is a prefix-cache hit) and prompt logprobs."""
    if params.n != 1:
        return ClientError.bad_value("n", params.n, "1 on the WebSocket protocol (one stream per request)")
    if params.prompt_logprobs is not None:
        return ClientError("prompt_logprobs are not carried by the WebSocket protocol (the OpenAI API's echo "
                           "returns them)", param="prompt_logprobs")
    return None
