"""One accepted request's answer: a whole ``chat.completion`` / ``text_completion``, or
server-sent events. However the answer ends (finished, the client hung up, a send stalled,
the server closed), the request is aborted if it still runs and its end is counted once.

A request with ``n`` > 1 (or completions' ``best_of``) is several engine requests, one per
sample (``state.samples``, SamplingParams.n): each becomes a choice with its ``index`` and
its own ``finish_reason``; a stream interleaves their chunks, each naming its choice, and
ends with one ``[DONE]`` once every sample has finished. ``usage`` counts the prompt once
and sums the samples' completion tokens (best_of: every sample run, as OpenAI bills them).

With tools (``tool_choice`` other than ``none``) each choice's text goes through a
:class:`~tokenloom.core.tools.ToolStream`: content as far as it is surely content, then a
``tool_calls`` delta per call once the parser has read it whole (its id, name and all its
arguments in one delta). The whole answer is that same stream read at once, so the two
agree; ``finish_reason`` is ``tool_calls`` when the model called and then stopped.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokenloom.core.outputs import Finished, TokenDelta, Usage
from tokenloom.core.tools import ToolCall, ToolStream
from tokenloom.protocols.openai import schema
from tokenloom.protocols.openai.rules import HTTPError


class Answer:
    def __init__(self, frontend, req, kind: str, state, *, prompt_text: str | None = None, tool_parser=None):
        self.frontend, self.req, self.kind, self.state = frontend, req, kind, state
        self.engine, self.metrics = frontend.engine, frontend.gateway.metrics
        self.states = list(getattr(state, "samples", None) or [state])
        self.n = req.n or 1  # choices returned; len(states) > n: best_of, the n best of them
        self.rid = state.request_id
        self.rids = [s.request_id for s in self.states]
        self.id = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + self.rid.removeprefix("oai-")
        # the served name, or the adapter's the request named (as vLLM answers)
        self.model = frontend.model if req.model in frontend.aliases else req.model
        self.created = int(time.time())
        self.finished = [False] * len(self.states)  # each sample's final result seen (and counted)
        # the client's own logprobs (best_of asks the engine for them to rank by)
        self.logprobs_asked = bool(req.logprobs) if kind == "chat.completion" else req.logprobs is not None
        self.echo = kind == "text_completion" and req.echo
        self.prompt_text = ""
        if self.echo:
            self.prompt_text = prompt_text if prompt_text is not None else \
                self.engine.tokenizer.decode(state.prompt_token_ids)
        self.tool_parser = tool_parser
        frontend.active.update(self.rids)

    # ---- shapes ---------------------------------------------------------------------------
    def _logprobs(self, entries, text: str, offset: int):
        if not entries or not self.logprobs_asked:
            return None
        tokenizer = self.engine.tokenizer
        if self.kind == "chat.completion":
            return schema.chat_logprobs(tokenizer, entries)
        return schema.completion_logprobs(tokenizer, entries, offset, len(text))

    def _echo_logprobs(self, scored):
        """The echoed prompt's piece of the legacy logprobs (``scored``: Finished.prompt_logprobs)."""
        if not self.logprobs_asked:
            return None
        entries = schema.prompt_entries(self.state.prompt_token_ids, scored)
        return schema.completion_logprobs(self.engine.tokenizer, entries, 0, len(self.prompt_text))

    @staticmethod
    def _tool_calls(calls: list[tuple[int, str, ToolCall]]) -> list[dict]:
        return [{"index": k, "id": call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}} for k, call_id, call in calls]

    def _tool_reason(self, reason: str, called: bool) -> str:
        return "tool_calls" if called and reason == "stop" else schema.finish_reason(reason)

    def _choice(self, index: int, text: str, logprobs, reason: str | None, *, stream: bool) -> dict:
        if self.kind == "text_completion":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if not stream:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": reason}
        delta = {} if reason is not None else {"content": text}  # the finish chunk's delta is empty
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _envelope(self, choices: list, *, stream: bool, **extra) -> dict:
        obj = self.kind + (".chunk" if stream and self.kind == "chat.completion" else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    @staticmethod
    def _usage(finals: list[Finished]) -> dict:
        """The prompt once (sample 0's), every sample's completion tokens."""
        first = finals[0].usage
        return schema.usage_body(Usage(prompt_tokens=first.prompt_tokens, cached_tokens=first.cached_tokens,
                                       completion_tokens=sum(f.usage.completion_tokens for f in finals)))

    # ---- the two ways to answer -------------------------------------------------------------
    async def whole(self, request: Request) -> Response:
        """Collect the answer, watching for the client hanging up (that aborts it)."""
        collect = [asyncio.ensure_future(_collect(self.engine.stream(s))) for s in self.states]
        everything = asyncio.gather(*collect)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([everything, gone], return_when=asyncio.FIRST_COMPLETED)
            if not everything.done():  # the client left: abort; each stream still ends with Finished
                for i, rid in enumerate(self.rids):
                    if not collect[i].done():
                        self.engine.abort(rid)
            results = await everything
            for i, (final, _) in enumerate(results):
                self._finished(i, final)  # before close(): its final result is consumed
        finally:
            gone.cancel()
            for c in collect:
                c.cancel()
            self.close()
        failed = next((f for f, _ in results if f.finish_reason == "error"), None)
        if failed is not None:  # 503, not 500: the engine restarts; retrying is right
            raise HTTPError(503, f"the engine failed on this request: {failed.error}", kind="server_error",
                            code="engine_error", retry_after_ms=self.engine.health_report().retry_after_ms)
        picked = list(range(len(results)))
        if len(results) > self.n:  # best_of: the n with the highest cumulative logprob
            picked = sorted(picked, key=lambda i: -sum(e.logprob for e in results[i][1]))[:self.n]
            picked.sort()
        choices = []
        for index, i in enumerate(picked):
            final, entries = results[i]
            text = final.text
            logprobs = self._logprobs(entries, text, len(self.prompt_text))
            if self.tool_parser is not None:
                reader = ToolStream(self.tool_parser)
                content, calls = reader.feed(text)
                more, later = reader.finish()
                calls = self._tool_calls(calls + later)
                message = {"role": "assistant", "content": (content + more) or (None if calls else "")}
                if calls:
                    message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
                choices.append({"index": index, "message": message, "logprobs": logprobs,
                                "finish_reason": self._tool_reason(final.finish_reason, bool(calls))})
                continue
            if self.echo:
                logprobs = schema.join_logprobs(self._echo_logprobs(results[0][0].prompt_logprobs), logprobs)
                text = self.prompt_text + text
            choices.append(self._choice(index, text, logprobs, schema.finish_reason(final.finish_reason),
                                        stream=False))
        return schema.json_response(self._envelope(choices, stream=False,
                                                   usage=self._usage([f for f, _ in results])))

    def events_response(self, include_usage: bool, send_timeout_s: float) -> Response:
        return _EventStream(self._events(include_usage), self.close, send_timeout_s)

    async def _events(self, include_usage: bool):
        """A role chunk per choice (chat), content chunks, each choice's finish chunk, the
        usage chunk when asked, then ``[DONE]``; an engine failure is an ``error`` event.
        What the engine has ready at once for a sample (deltas that piled up, the last delta
        and the end) goes out in one write. With ``echo`` each choice starts with the prompt
        (and its logprobs, which come with sample 0's first delta)."""
        usage_none = {"usage": None} if include_usage else {}
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, state) -> None:
            async for ready in self.engine.stream(state, batched=True):
                merged.put_nowait((i, ready))

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.states)]
        offsets = [len(self.prompt_text)] * len(self.states)
        finals: list[Finished | None] = [None] * len(self.states)
        failed = False
        echoed = not self.echo
        held: list = []  # other samples' output until the echo went out (it leads every choice)
        readers = [ToolStream(self.tool_parser) for _ in self.states] if self.tool_parser is not None else None

        def tool_frames(i: int, content: str, calls: list, logprobs) -> list[bytes]:
            frames = []
            if content or logprobs:
                frames.append(_sse(self._envelope([{"index": i, "delta": {"content": content}, "logprobs": logprobs,
                                                    "finish_reason": None}], stream=True, **usage_none)))
            if calls:
                frames.append(_sse(self._envelope([{"index": i, "delta": {"tool_calls": self._tool_calls(calls)},
                                                    "logprobs": None, "finish_reason": None}],
                                                  stream=True, **usage_none)))
            return frames

        def echo_frames(scored) -> list[bytes]:
            logprobs = self._echo_logprobs(scored)
            return [_sse(self._envelope([self._choice(i, self.prompt_text, logprobs, None, stream=True)],
                                        stream=True, **usage_none)) for i in range(len(self.states))]

        def frames_of(i: int, ready: list) -> list[bytes]:
            nonlocal failed
            frames = []
            for item in ready:
                if isinstance(item, Finished):
                    self._finished(i, item)
                    finals[i] = item
                    if item.finish_reason == "error":
                        if not failed:
                            failed = True
                            frames.append(_sse(schema.error_body(f"the engine failed on this request: {item.error}",
                                                                 kind="server_error", code="engine_error")))
                    else:
                        reason = schema.finish_reason(item.finish_reason)
                        if readers is not None:
                            content, calls = readers[i].finish()
                            frames += tool_frames(i, content, calls, None)
                            reason = self._tool_reason(item.finish_reason, bool(readers[i].calls))
                        finish = self._choice(i, "", None, reason, stream=True)
                        frames.append(_sse(self._envelope([finish], stream=True, **usage_none)))
                elif readers is not None:
                    content, calls = readers[i].feed(item.text)
                    frames += tool_frames(i, content, calls, self._logprobs(item.logprobs, item.text, 0))
                elif item.text or item.logprobs:
                    logprobs = self._logprobs(item.logprobs, item.text, offsets[i])
                    offsets[i] += len(item.text)
                    frames.append(_sse(self._envelope([self._choice(i, item.text, logprobs, None, stream=True)],
                                                      stream=True, **usage_none)))
            return frames

        try:
            if self.kind == "chat.completion":
                firsts = [_sse(self._envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}],
                                              stream=True, **usage_none)) for i in range(len(self.states))]
                yield b"".join(firsts)
            wait_for_scores = self.echo and self.logprobs_asked
            if self.echo and not wait_for_scores:
                yield b"".join(echo_frames(None))
                echoed = True
            while any(f is None for f in finals):
                i, ready = await merged.get()
                frames: list[bytes] = []
                if not echoed:
                    if i != 0:
                        held.append((i, ready))
                        continue
                    scored = next((x.prompt_logprobs for x in ready if isinstance(x, TokenDelta)
                                   and x.prompt_logprobs), None)
                    if scored is None and not any(isinstance(x, Finished) for x in ready):
                        held.append((i, ready))  # (a delta before the scores: none is sent first)
                        continue
                    if scored is None:
                        scored = next(x.prompt_logprobs for x in ready if isinstance(x, Finished))
                    frames += echo_frames(scored)
                    echoed = True
                    for j, other in held:
                        frames += frames_of(j, other)
                    held.clear()
                frames += frames_of(i, ready)
                if frames:
                    yield b"".join(frames)
            tail = []
            if include_usage and not failed:
                tail.append(_sse(self._envelope([], stream=True, usage=self._usage([f for f in finals if f]))))
            tail.append(b"data: [DONE]\n\n")
            yield b"".join(tail)
        finally:
            for p in pumps:
                p.cancel()
            # a final result a pump had passed on but nobody read yet still counts (close() waits for
            # the others)
            for i, ready in held + _drain(merged):
                for item in ready:
                    if isinstance(item, Finished):
                        self._finished(i, item)

    # ---- the end --------------------------------------------------------------------------
    def _finished(self, i: int, final: Finished) -> None:
        if not self.finished[i]:
            self.finished[i] = True
            if i:  # the prompt counts once, with sample 0
                final = msgspec.structs.replace(final, usage=msgspec.structs.replace(
                    final.usage, prompt_tokens=0, cached_tokens=0))
            self.metrics.observe_finished(final.finish_reason, final)

    def close(self) -> None:
        """The answer is over: abort the samples that still run (the client left), and
        count their ends once the engine has ended them. Whether or not this abort is the
        one that ends a sample (leaving the engine's stream aborts too, and the engine may
        have ended it meanwhile), its final result has not been consumed yet, so it is
        awaited here."""
        self.frontend.active.difference_update(self.rids)
        for i, state in enumerate(self.states):
            if not self.finished[i]:
                self.engine.abort(state.request_id)
                task = asyncio.ensure_future(self._count_abort(i, state))
                self.frontend.background.add(task)
                task.add_done_callback(self.frontend.background.discard)

    async def _count_abort(self, i: int, state) -> None:
        async for item in self.engine.stream(state):
            if isinstance(item, Finished):
                self._finished(i, item)


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


def _drain(queue: asyncio.Queue) -> list:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


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
