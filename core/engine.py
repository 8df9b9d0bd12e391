"""AsyncEngine: owns the request lifecycle. One asyncio task runs the step loop
(schedule -> execute in a worker thread -> update); every request gets a stream of
TokenDeltas that ends with exactly one Finished."""

from __future__ import annotations

import asyncio
import heapq
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from tokenloom.core.build import EngineParts, build_engine_parts
from tokenloom.core.config import EngineConfig
from tokenloom.core.detokenizer import IncrementalDetokenizer
from tokenloom.core.errors import ClientError
from tokenloom.core.executor import ExecutorFailed
from tokenloom.core.health import EngineHealth, HealthReport
from tokenloom.core.inputs import check_length, encode_prompt, refuse_by_size
from tokenloom.core.interfaces import DecoderOutput
from tokenloom.core.metrics import EngineCounters, StepStats, engine_stats
from tokenloom.core.outputs import Finished, TokenDelta, stream_request
from tokenloom.core.plugins import PluginManager
from tokenloom.core.requests import RequestState, Sink
from tokenloom.core.sampler import TokenLogprob
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Batch, Sequence, SequenceStatus

log = structlog.get_logger("tokenloom.engine")


class AsyncEngine:
    """``engine.generate(prompt, params)`` -> async iterator of TokenDelta ... Finished."""

    def __init__(self, config: EngineConfig, *, plugin_manager: PluginManager | None = None, progress=None):
        self.config = config
        self.pm = plugin_manager or PluginManager()
        # All torch work runs on this one thread, the model load included. libgomp gives every
        # thread that runs a parallel region its own team, and once a process manages more
        # OpenMP threads than it has cores, idle ones stop spinning and sleep: each of a decode
        # step's ~1,000 small parallel regions then waits for a wake-up (measured here: a batch-1
        # step 10.4 ms when one thread ever ran torch, 21 ms when two did).
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-step")
        parts: EngineParts = self._step_thread.submit(build_engine_parts, config, self.pm, progress).result()
        self.tokenizer, self.model_config = parts.tokenizer, parts.model_config
        self.model_name, self.max_model_len = parts.model_name, parts.max_model_len
        self.runner, self.cache, self.scheduler, self.decoder = parts.runner, parts.cache, parts.scheduler, parts.decoder
        self.executor = parts.executor  # how steps reach the runner(s): one, or a tensor-parallel group
        self.counters = EngineCounters()
        self._decoder_names = sorted(self.pm.entries("decoder"))
        self._requests: dict[str, RequestState] = {}
        self._pending_aborts: list[str] = []
        self._pending: dict[str, _Pending] = {}  # committed outputs not yet published, by request id
        self.overlap = config.engine.overlap
        # Long prompts are tokenised here, off the event loop and beside the step thread.
        self._tokenize_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenloom-tokenize")
        self._loop_task: asyncio.Task | None = None
        # replaced by each new step-loop task (an Event binds to the event loop that first waits on it)
        self._wakeup = asyncio.Event()
        self._deadlines: list[tuple[float, int, str]] = []  # heap of (deadline, seq_id, request_id)
        self.health = EngineHealth(config.engine.max_restarts, config.engine.restart_backoff_s)
        self.dead_event = asyncio.Event()  # set once the engine gives up (see core/health.py)
        self._observe_steps = self.pm.has_impl("step_finished")
        self._observe_requests = self.pm.has_impl("request_finished")
        self._started_hook_called = False
        self._closed = False

    @classmethod
    def from_options(cls, config_file=None, flags=None, plugin_manager=None, progress=None, **kwargs):
        from tokenloom.core.build import config_from_sources

        pm = plugin_manager or PluginManager()
        return cls(config_from_sources(pm, config_file, flags, kwargs), plugin_manager=pm, progress=progress)

    # ---- submission -------------------------------------------------------------
    def _ensure_loop(self) -> None:
        self._check_executor()
        self.health.check(time.monotonic())  # raises EngineUnavailable while restarting or dead
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop(), name="tokenloom-step-loop")
            if not self._started_hook_called:
                self._started_hook_called = True
                self.pm.hook.engine_started(config=self.config, engine=self)

    def prompt_ids(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                   parse_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a request's input (see :func:`encode_prompt`); a text that cannot
        fit the context is refused before it is tokenised."""
        refuse_by_size(self.tokenizer, self.max_model_len, prompt, messages)
        return encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt, messages,
                             parse_special_tokens=parse_special_tokens)

    async def prompt_ids_async(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                               parse_special_tokens: bool | None = None) -> list[int]:
        """:meth:`prompt_ids` for servers: text is tokenised in a worker thread, so a long
        prompt never stalls the event loop (other clients' streams, pings)."""
        if prompt is not None and not isinstance(prompt, str):
            return self.prompt_ids(prompt, messages, parse_special_tokens)
        refuse_by_size(self.tokenizer, self.max_model_len, prompt, messages)  # before any thread hop
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_executor, self.prompt_ids, prompt, messages, parse_special_tokens)

    def submit(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, *,
               messages: list[dict] | None = None, request_id: str | None = None,
               cache_salt: str | None = None, parse_special_tokens: bool | None = None,
               sink: Sink | None = None) -> RequestState:
        """Validate and enqueue; raises ClientError before anything is accepted, and
        EngineUnavailable while the engine cannot serve. Requests with different
        ``cache_salt`` never share prefix-cache blocks (tenants). A server tokenises first
        with :meth:`prompt_ids_async` and submits the ids. The request's outputs go to a new
        queue that :meth:`stream` reads, or to ``sink``."""
        params = params or SamplingParams()
        params.validate(self.model_config.vocab_size)
        if params.decoder is not None and params.decoder not in self._decoder_names:
            raise ClientError(f"unknown decoder {params.decoder!r}; known: {', '.join(self._decoder_names)}",
                              param="decoder", value=params.decoder)
        if params.decoder is not None and params.decoder in self.decoder.unavailable:
            raise ClientError(f"decoder {params.decoder!r} is unavailable here ({self.decoder.unavailable[params.decoder]})",
                              param="decoder", value=params.decoder)
        self._ensure_loop()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ClientError(f"request id {request_id!r} is already in use", param="request_id", value=request_id)
        ids = self.prompt_ids(prompt, messages, parse_special_tokens)
        check_length(len(ids), params.max_tokens, self.max_model_len)
        if cache_salt is not None and (not isinstance(cache_salt, str) or len(cache_salt) > 256):
            raise ClientError.bad_value("cache_salt", cache_salt, "a string of at most 256 characters")
        seq = Sequence(request_id, ids, params, eos_token_ids=self.tokenizer.eos_token_ids, cache_salt=cache_salt)
        self.scheduler.add(seq)  # may raise RequestTooLong (can never fit the cache)
        req = RequestState(seq, IncrementalDetokenizer(self.tokenizer, ids, params.stop),
                           asyncio.Queue() if sink is None else sink)
        self._requests[request_id] = req
        if params.timeout_s is not None:
            heapq.heappush(self._deadlines, (seq.arrival_time + params.timeout_s, seq.seq_id, request_id))
        self.counters.prompt_tokens += len(ids)
        self._wakeup.set()
        return req

    async def submit_async(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                           cache_salt: str | None = None) -> RequestState:
        """A server's way in (the gateway's): :meth:`submit` here; across a process boundary
        (core/engine_process.py) it waits for the core to accept or refuse."""
        return self.submit(prompt_ids, params, request_id=request_id, cache_salt=cache_salt)

    async def refresh_stats(self) -> None:
        """Make :meth:`stats` current (a no-op here; the engine core in its own process is
        asked for its numbers)."""

    def kv_block_map(self) -> str:
        """One digit per KV block: 0 free, 1 used, 2 cached (the playground's map)."""
        return "".join(map(str, self.cache.block_states()))

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (what one request can at most use)."""
        return self.cache.num_blocks * self.cache.block_size

    async def generate(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, *,
                       messages: list[dict] | None = None, request_id: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[TokenDelta | Finished]:
        req = self.submit(prompt, params, messages=messages, request_id=request_id, cache_salt=cache_salt)
        async for item in self.stream(req):
            yield item

    def stream(self, req: RequestState, *, batched: bool = False) -> AsyncIterator:
        """Iterate a submitted request's deltas and its final result; deltas that piled up
        while the reader was busy come as one. ``batched``: lists of what is ready at once
        (see :func:`~tokenloom.core.outputs.read_ready`). Leaving early aborts it."""
        return stream_request(req, self.abort, batched=batched)

    def abort(self, request_id: str) -> bool:
        """Abort at the next step boundary; the stream ends with Finished('aborted')."""
        req = self._requests.get(request_id)
        if req is None or req.done or req.ending is not None:  # over, or its end already committed
            return False
        self._pending_aborts.append(request_id)
        self._wakeup.set()
        return True

    # ---- the step loop ------------------------------------------------------------
    async def _run_loop(self) -> None:
        """schedule -> step (worker thread) -> commit -> publish. With ``engine.overlap`` a
        step's outputs are published (detokenised, streamed, timed, logged) while the next
        step runs, vLLM's "async output processing": only what the next schedule depends on
        -- tokens appended, stops found, finished sequences' blocks freed -- stays between
        two steps (:meth:`_commit`), so the tokens are the same either way."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_aborts()
                self._expire_deadlines(time.monotonic())
                if not self.scheduler.has_unfinished():
                    self._publish()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                batch = self.scheduler.schedule()
                if batch.is_empty:
                    self._publish()
                    await asyncio.sleep(0.001)
                    continue
                t0 = time.perf_counter()
                step = loop.run_in_executor(self._step_thread, self.decoder.step, batch)
                self._publish()  # the previous step's outputs, while this one runs
                out = await step
                self._commit(batch, out, time.perf_counter() - t0)
                if not self.overlap:
                    self._publish()
                self.health.on_success()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the step failed: end every request, keep nothing hanging
            self._on_step_failure(exc)

    def _on_step_failure(self, exc: Exception) -> None:
        """End every request with an error, give their blocks back, then let the restart
        policy (core/health.py) decide when the loop may run again."""
        fatal = isinstance(exc, ExecutorFailed)  # a rank is gone: no restart can bring it back
        self.health.on_failure(exc, time.monotonic(), fatal=fatal)
        log.exception("engine_step_failed", error=str(exc), failures=self.health.failures,
                      consecutive=self.health.consecutive, dead=self.health.dead)
        self._pending_aborts.clear()
        self._publish()  # what earlier steps committed reaches its streams first
        error = f"internal error: {exc.public if isinstance(exc, ExecutorFailed) else type(exc).__name__}"
        for req in list(self._requests.values()):
            self._end_early(req, SequenceStatus.FINISHED_ERROR, error=error)
        if self.health.dead:
            self.dead_event.set()

    def health_report(self) -> HealthReport:
        self._check_executor()
        return self.health.report(time.monotonic())

    def _check_executor(self) -> None:
        """A rank lost while the engine idles makes it dead now, not at the next request."""
        if self.executor.failed is not None and not self.health.dead:
            self.health.on_failure(ExecutorFailed(self.executor.failed, self.executor.failed), time.monotonic(),
                                   fatal=True)
            self.dead_event.set()

    def _expire_deadlines(self, now: float) -> None:
        """Requests past ``timeout_s`` end like aborts (blocks back now), reason ``timeout``."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq_id, request_id = heapq.heappop(self._deadlines)
            req = self._requests.get(request_id)
            if req is not None and req.seq.seq_id == seq_id and not req.done and req.ending is None:
                self._end_early(req, SequenceStatus.FINISHED_TIMEOUT)

    def _apply_aborts(self) -> None:
        while self._pending_aborts:
            req = self._requests.get(self._pending_aborts.pop())
            if req is not None and not req.done and req.ending is None:
                self._end_early(req, SequenceStatus.FINISHED_ABORTED)

    def _end_early(self, req: RequestState, status: SequenceStatus, error: str | None = None) -> None:
        """Abort, timeout or failure: the scheduler drops the sequence and frees its blocks
        now; tokens it already committed are published first."""
        pending = self._pending.pop(req.seq.request_id, None)
        if pending is not None:
            self._publish_one(pending)
            if req.done:
                return
        self.scheduler.abort(req.seq.request_id)
        self.decoder.release(req.seq)
        self._finish(req, status, error)

    def _commit(self, batch: Batch, out: DecoderOutput, step_time: float) -> None:
        """What the next schedule depends on: each sequence's computed tokens, its new tokens,
        whether it stops (a stop string needs the text: those requests detokenise here), and
        for a finished one its blocks back. The rest waits in ``_pending`` for :meth:`_publish`."""
        self.scheduler.observe(batch, step_time)  # before the results move num_computed_tokens
        now = time.monotonic()
        generated = prefill_tokens = decode_seqs = 0
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            req = self._requests[seq.request_id]
            res = out.get(seq)
            # Accepted drafts' KV was written this step: they count as computed; rejected
            # lookahead slots are simply overwritten by later steps.
            seq.num_computed_tokens += n + (res.num_accepted if res is not None else 0)
            req.timer.on_scheduled(now)
            if n > 1 or seq.num_computed_tokens <= seq.num_prompt_tokens:
                prefill_tokens += n
            else:
                decode_seqs += 1
            if res is None or not res.token_ids:
                continue
            status, accepted = None, []
            for tok in res.token_ids:
                seq.append_token(tok)
                accepted.append(tok)
                status = req.check_stop(tok, self.max_model_len, detokenize=req.detok.needs_text)
                if status is not None:
                    break
            # A stop inside the accepted drafts appends fewer tokens than were computed: KV
            # exists only for tokens the sequence has (a prefix cache registers up to here).
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            req.num_drafted += res.num_drafted
            req.num_accepted += res.num_accepted
            generated += len(accepted)
            earlier = self._pending.pop(seq.request_id, None)
            if earlier is not None:  # (the loop publishes before every commit: kept in order regardless)
                self._publish_one(earlier)
            self._pending[seq.request_id] = _Pending(req, accepted, res.logprobs[:len(accepted)] if res.logprobs
                                                     else None, status)
            if status is not None:
                req.ending = status
                if status in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH):
                    self.scheduler.finish(seq)
                self.decoder.release(seq)
        c = self.counters
        c.steps += 1
        c.generated_tokens += generated
        c.busy_time_s += step_time
        c.preemptions += len(batch.preempted)
        c.peak_kv_usage = max(c.peak_kv_usage, self.cache.num_used_blocks / self.cache.num_blocks)
        c.peak_running = max(c.peak_running, len(batch.seqs))
        if self._observe_steps:  # full stats only for observers: a radix cache walks its tree
            cache_stats = self.cache.stats()
            self.pm.hook.step_finished(stats=StepStats(
                step=c.steps, step_time_ms=step_time * 1e3, num_running=self.scheduler.num_running,
                num_waiting=self.scheduler.num_waiting, num_batched_tokens=batch.num_batched_tokens,
                num_prefill_tokens=prefill_tokens, num_decode_seqs=decode_seqs, num_generated_tokens=generated,
                num_preempted=len(batch.preempted), total_preemptions=c.preemptions, kv_usage=cache_stats.usage,
                num_free_blocks=cache_stats.num_free_blocks, num_blocks=cache_stats.num_blocks,
                prefix_hit_rate=cache_stats.hit_rate))

    def _publish(self) -> None:
        """Everything committed and not yet published reaches its stream: text, ids,
        logprobs, token times; a finished request's Finished."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for item in pending.values():
            self._publish_one(item)

    def _publish_one(self, item: _Pending) -> None:
        req = item.req
        if req.done:
            return
        if not req.detok.needs_text:  # its text was left for now: nothing waited on it
            # (a stop token id ends the text before it, as check_stop does)
            for tok in item.token_ids[:len(item.token_ids) - (item.status is SequenceStatus.FINISHED_STOPPED)]:
                req.detok.add(tok)
        req.timer.on_tokens(time.monotonic(), len(item.token_ids))
        req.emit(item.token_ids, item.logprobs, final=item.status is not None)
        if item.status is not None:
            self._finish(req, item.status)

    def _finish(self, req: RequestState, status: SequenceStatus, error: str | None = None) -> None:
        """The one Finished; the sequence's blocks are back already (_commit, _end_early)."""
        seq = req.seq
        final = req.finish(status, error)
        self.scheduler.on_finished(seq, final)
        del self._requests[seq.request_id]
        self.counters.finished_requests += 1
        m = final.metrics
        log.info("request_finished", request_id=seq.request_id, finish_reason=final.finish_reason,
                 prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens,
                 ttft_ms=_r(m.ttft_ms), tpot_ms=_r(m.tpot_ms), e2e_ms=_r(m.e2e_ms), preemptions=m.num_preemptions)
        if self._observe_requests:
            self.pm.hook.request_finished(request_id=seq.request_id, output=final)

    # ---- introspection and shutdown ---------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def stats(self) -> dict:
        return engine_stats(self.cache.stats(), self.scheduler, self.counters, self.decoder.stats(),
                            self.scheduler.stats())

    async def shutdown(self) -> None:
        for rid in list(self._requests):
            self.abort(rid)
        if self._loop_task is not None and not self._loop_task.done():
            while self._requests and not self._loop_task.done():
                await asyncio.sleep(0.005)
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self._loop_task = None

    def call_in_step_thread(self, fn, *args, **kwargs):
        """Run ``fn`` on the engine's torch thread and wait for it (scoring, calibration).
        Not from a running event loop: it blocks until the step in flight, if any, is done."""
        return self._step_thread.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._step_thread.submit(self.executor.close).result()  # other ranks stop (tensor parallelism)
        self._step_thread.shutdown(wait=True)
        self._tokenize_executor.shutdown(wait=True)


@dataclass(slots=True)
class _Pending:
    """One request's committed, unpublished part of a step."""

    req: RequestState
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token, when the request asked for them
    status: SequenceStatus | None


def _r(x: float | None) -> float | None:
    return round(x, 2) if x is not None else None

