"""What a request's stream yields: TokenDeltas, then exactly one Finished."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec


class Logprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class TokenLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    token_id: int
    logprob: float
    top: list[Logprob] = msgspec.field(default_factory=list)


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class RequestMetrics(msgspec.Struct, frozen=True, kw_only=True):
    ttft_ms: float | None  # arrival -> first token
    tpot_ms: float | None  # mean time per output token after the first
    e2e_ms: float  # arrival -> finish
    queue_ms: float | None  # arrival -> first scheduled
    itl_ms: list[float] = msgspec.field(default_factory=list)  # gaps between token arrivals
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified
    num_accepted_tokens: int = 0  # of which accepted (each step also emits one target token)
    drafted_by: dict[str, int] = msgspec.field(default_factory=dict)  # draft tokens per decoder that proposed them


class TokenDelta(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    # SamplingParams.prompt_logprobs: once, before any token (None for the first prompt token)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    finish_reason: str  # stop | length | aborted | timeout | error
    text: str  # the whole generated text (== concatenation of the deltas)
    token_ids: list[int]
    usage: Usage
    metrics: RequestMetrics
    error: str | None = None
    index: int = 0  # which of the request's samples (SamplingParams.n) this is
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # sample 0's, when asked for


def merge_deltas(a: TokenDelta, b: TokenDelta) -> TokenDelta:
    """Two consecutive deltas of one request as one (a stream that fell behind sends what
    is ready in one frame): text, ids and logprobs concatenated."""
    logprobs = None if a.logprobs is None and b.logprobs is None else [*(a.logprobs or ()), *(b.logprobs or ())]
    return TokenDelta(request_id=a.request_id, text=a.text + b.text, token_ids=a.token_ids + b.token_ids,
                      logprobs=logprobs, prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs)


async def read_stream(queue) -> AsyncIterator[TokenDelta | Finished]:
    """A request's queue as a stream that coalesces: the deltas already waiting when the
    reader comes back are yielded as one (a reader that keeps up gets one per step), then
    the Finished, which ends it."""
    async for ready in read_ready(queue):
        for item in ready:
            yield item


async def read_ready(queue) -> AsyncIterator[list[TokenDelta | Finished]]:
    """:func:`read_stream` by what is ready at once: [delta], [delta, Finished] or
    [Finished], so that a frontend writes each in one send."""
    while True:
        item = await queue.get()
        ready: list[TokenDelta | Finished] = [item]
        if isinstance(item, TokenDelta):
            while not queue.empty():
                nxt = queue.get_nowait()
                if isinstance(nxt, TokenDelta):
                    item = ready[0] = merge_deltas(item, nxt)
                else:
                    ready.append(nxt)
                    break
        yield ready
        if isinstance(ready[-1], Finished):
            return


async def stream_request(req, abort, *, batched: bool = False) -> AsyncIterator:
    """A submitted request's stream (``req.queue``, ``req.done``, ``req.request_id``), by
    item or, ``batched``, by what is ready at once; leaving early calls ``abort(request_id)``
    (the consumer went away: the engine does not generate for nobody)."""
    try:
        if batched:
            async for ready in read_ready(req.queue):
                yield ready
        else:
            async for item in read_stream(req.queue):
                yield item
    finally:
        if not req.done:
            abort(req.request_id)


RequestOutput = Finished  # the hook spec's name for the final result
