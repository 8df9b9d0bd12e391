"""One accepted request's side of the engine: its sequence, its detokenizer and the stream
the caller reads (TokenDelta ... then exactly one Finished)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenloom.core.detokenizer import IncrementalDetokenizer
from tokenloom.core.metrics import RequestTimer
from tokenloom.core.outputs import Finished, Logprob, TokenDelta, TokenLogprobs, Usage
from tokenloom.core.sampler import TokenLogprob
from tokenloom.core.sequence import FINISH_REASONS, Sequence, SequenceStatus


def sample_request_ids(request_id: str, n: int) -> list[str]:
    """The request ids of a request's ``n`` samples: its own for sample 0, ``id#i`` after."""
    return [request_id] + [f"{request_id}#{i}" for i in range(1, n)]


class Sink(Protocol):
    """Where a request's TokenDeltas and its Finished go: an ``asyncio.Queue`` its reader
    awaits, or (the engine core in its own process) the outbox of the next message."""

    def put_nowait(self, item: TokenDelta | Finished, /) -> None: ...


@dataclass(eq=False, slots=True)
class RequestState:
    seq: Sequence
    detok: IncrementalDetokenizer
    queue: Sink
    timer: RequestTimer = field(default_factory=RequestTimer)
    done: bool = False
    num_drafted: int = 0  # draft tokens verified for this request (speculative decoders)
    num_accepted: int = 0  # of which accepted
    drafted_by: dict[str, int] = field(default_factory=dict)  # draft tokens per decoder that proposed them
    ending: SequenceStatus | None = None  # its end is committed; the Finished is on its way
    index: int = 0  # which sample of its request (SamplingParams.n) this is
    # every sample of the request, in index order (this one included): all n share the prompt
    samples: list[RequestState] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # SamplingParams.prompt_logprobs (sample 0)

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.token_ids[:self.seq.num_prompt_tokens]

    def check_stop(self, tok: int, max_model_len: int, detokenize: bool = True) -> SequenceStatus | None:
        """After appending ``tok``: does the sequence end here, and why? ``detokenize=False``
        leaves the text for later (the caller then adds ``tok`` to the detokenizer itself):
        only stop strings need it now."""
        seq, p = self.seq, self.seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in seq.eos_token_ids):
            return SequenceStatus.FINISHED_STOPPED
        if detokenize and self.detok.add(tok):
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def emit(self, token_ids: list[int], token_logprobs: list[TokenLogprob] | None, final: bool) -> None:
        """Queue this step's delta: text the detokenizer can release, ids, and the step's
        logprobs (one per token, when the request asked for them)."""
        text = self.detok.take_delta(final)
        logprobs = None
        if token_logprobs:
            logprobs = [TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                                      top=[Logprob(t, v) for t, v in lp.top]) for lp in token_logprobs]
        if text or token_ids:
            self.queue.put_nowait(TokenDelta(request_id=self.seq.request_id, text=text,
                                             token_ids=token_ids, logprobs=logprobs))

    def emit_prompt_logprobs(self, entries: list[TokenLogprobs | None]) -> None:
        """The prompt's logprobs, once, before any token."""
        self.prompt_logprobs = entries
        self.queue.put_nowait(TokenDelta(request_id=self.seq.request_id, text="", token_ids=[],
                                         prompt_logprobs=entries))

    def finish(self, status: SequenceStatus, error: str | None = None) -> Finished:
        """Queue any held-back text, then the one Finished; returns it."""
        seq = self.seq
        seq.status = status
        tail = self.detok.take_delta(final=True)
        if tail:
            self.queue.put_nowait(TokenDelta(request_id=seq.request_id, text=tail, token_ids=[]))
        self.done = True
        final = Finished(
            request_id=seq.request_id, finish_reason=FINISH_REASONS[status], text=self.detok.text,
            token_ids=seq.output_token_ids,
            usage=Usage(prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
                        completion_tokens=seq.num_output_tokens),
            metrics=self.timer.finish(seq.num_preemptions, self.num_drafted, self.num_accepted, self.drafted_by), error=error,
            index=self.index, prompt_logprobs=self.prompt_logprobs)
        self.queue.put_nowait(final)
        return final
