"""AsyncEngine: owns the request lifecycle. One asyncio task runs the step loop
(schedule -> execute in a worker thread -> update); every request gets a stream of
TokenDeltas that ends with exactly one Finished."""

from __future__ import annotations

import asyncio
import functools
import heapq
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import structlog

from tokenloom.core import contracts
from tokenloom.core.build import EngineParts, build_engine_parts
from tokenloom.core.config import EngineConfig
from tokenloom.core.detokenizer import IncrementalDetokenizer
from tokenloom.core.errors import AdaptersBusy, ClientError, NotFound, RequestTooLong
from tokenloom.core.executor import ExecutorFailed
from tokenloom.core.grammar import GrammarState
from tokenloom.core.health import EngineHealth, HealthReport
from tokenloom.core.inputs import check_length, encode_prompt, refuse_by_size
from tokenloom.core.interfaces import AdapterInfo, DecoderOutput
from tokenloom.core.metrics import EngineCounters, StepStats, engine_stats
from tokenloom.core.outputs import Finished, Logprob, TokenDelta, TokenLogprobs, stream_request
from tokenloom.core.plugins import PluginManager
from tokenloom.core.requests import RequestState, Sink, sample_request_ids
from tokenloom.core.sampler import TokenLogprob
from tokenloom.core.sampling_params import MAX_SEED, Constraint, SamplingParams
from tokenloom.core.sequence import Batch, Sequence, SequenceStatus

log = structlog.get_logger("tokenloom.engine")
GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept (by constraint)


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
        # adapters by name (the executor's, refreshed on load/unload); those being unloaded
        # take no new request and go once no live request uses them
        self._adapters: dict[str, AdapterInfo] = {a.name: a for a in self.executor.adapters()}
        self._unloading: set[str] = set()
        manager = parts.runner.adapters
        self._max_loras = manager.max_loras if manager is not None and not manager.merged else 0
        self._adapter_lock = asyncio.Lock()
        # decoders whose draft model does not carry an adapter: adapter requests decode plainly
        self._draft_decoders = {n for n, e in self.pm.entries("decoder").items() if e.loads_model}
        if parts.runner.adapters is not None:
            log.info("adapters_enabled", adapters=sorted(self._adapters), merged=parts.runner.adapters.merged,
                     max_loras=parts.runner.adapters.max_loras, draft_decoders_step_aside=sorted(self._draft_decoders),
                     note="adapter requests never use a draft model's decoder (its draft has no adapter): "
                          "they decode with standard instead; ngram and medusa verify under the adapter")
        self._requests: dict[str, RequestState] = {}
        self._pending_aborts: list[str] = []
        self._pending: dict[str, _Pending] = {}  # committed outputs not yet published, by request id
        self._scoring: deque[RequestState] = deque()  # prompt_logprobs requests whose prompt is not yet scored
        self._owed_copies: list[tuple[int, int, int]] = []  # KV copies taken from the cache, not yet run
        self.overlap = config.engine.overlap
        # Long prompts are tokenised here, off the event loop and beside the step thread.
        self._tokenize_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenloom-tokenize")
        # Structured outputs: the grammar backend compiles constraints on a thread of its own
        # (neither the event loop nor the step thread); compiled grammars, or the compile in
        # flight, are kept per constraint (an LRU of futures, failures included).
        self.grammar = contracts.build(self.pm.get("grammar", config.engine.grammar_backend), None,
                                       self.tokenizer, self.model_config.vocab_size)
        self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-grammar")
        self._grammars: OrderedDict[bytes, Future] = OrderedDict()
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
                   parse_special_tokens: bool | None = None, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a request's input (see :func:`encode_prompt`); a text that cannot
        fit the context is refused before it is tokenised."""
        refuse_by_size(self.tokenizer, self.max_model_len, prompt, messages)
        return encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt, messages,
                             parse_special_tokens=parse_special_tokens, tools=tools)

    async def prompt_ids_async(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                               parse_special_tokens: bool | None = None, tools: list[dict] | None = None) -> list[int]:
        """:meth:`prompt_ids` for servers: text is tokenised in a worker thread, so a long
        prompt never stalls the event loop (other clients' streams, pings)."""
        if prompt is not None and not isinstance(prompt, str):
            return self.prompt_ids(prompt, messages, parse_special_tokens)
        refuse_by_size(self.tokenizer, self.max_model_len, prompt, messages)  # before any thread hop
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_executor, functools.partial(self.prompt_ids, prompt, messages, parse_special_tokens, tools))

    def submit(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, *,
               messages: list[dict] | None = None, request_id: str | None = None,
               cache_salt: str | None = None, parse_special_tokens: bool | None = None,
               sink: Sink | None = None) -> RequestState:
        """Validate and enqueue; raises ClientError before anything is accepted, and
        EngineUnavailable while the engine cannot serve. Requests with different
        ``cache_salt`` never share prefix-cache blocks (tenants). A server tokenises first
        with :meth:`prompt_ids_async` and submits the ids. The request's outputs go to a new
        queue that :meth:`stream` reads, or to ``sink``.

        With ``params.n > 1`` the request is ``n`` samples, each a request of its own (ids
        from :func:`~tokenloom.core.requests.sample_request_ids`: ``request_id``, then
        ``request_id#1`` ...; with a seed, sample i's is ``seed + i``) with its own stream
        (each its own queue; with ``sink``, all into it) and its own ``Finished``
        (``index``). The prompt is prefilled once, by sample 0: in the step that samples
        its first token every other sample draws its own first token from the same logits,
        then forks sample 0's KV blocks (:meth:`_fork_samples`). Returns sample 0's state;
        ``req.samples`` holds all n."""
        params = params or SamplingParams()
        params.validate(self.model_config.vocab_size)
        if params.decoder is not None and params.decoder not in self._decoder_names:
            raise ClientError(f"unknown decoder {params.decoder!r}; known: {', '.join(self._decoder_names)}",
                              param="decoder", value=params.decoder)
        if params.decoder is not None and params.decoder in self.decoder.unavailable:
            raise ClientError(f"decoder {params.decoder!r} is unavailable here ({self.decoder.unavailable[params.decoder]})",
                              param="decoder", value=params.decoder)
        if params.adapter is not None:
            params = self._adapter_params(params)
        self._ensure_loop()
        grammar: Future | None = None
        if params.constraint is not None:
            grammar = self._grammar_future(params.constraint)
            if grammar.done():
                grammar.result()  # a constraint that failed to compile: its ClientError, now
        request_id = request_id or uuid.uuid4().hex
        rids = sample_request_ids(request_id, params.n)
        for rid in rids:
            if rid in self._requests:
                raise ClientError(f"request id {rid!r} is already in use", param="request_id", value=request_id)
        ids = self.prompt_ids(prompt, messages, parse_special_tokens)
        check_length(len(ids), params.max_tokens, self.max_model_len)
        if cache_salt is not None and (not isinstance(cache_salt, str) or len(cache_salt) > 256):
            raise ClientError.bad_value("cache_salt", cache_salt, "a string of at most 256 characters")
        if params.adapter is not None:  # an adapter's KV is its own: never shared with the base or another
            cache_salt = f"{cache_salt or ''}\x00adapter:{self._adapters[params.adapter].fingerprint}"
        seqs = []
        for i, rid in enumerate(rids):
            sp = params
            if params.n > 1:
                seed = None if params.seed is None else (params.seed + i) % (MAX_SEED + 1)
                sp = msgspec.structs.replace(params, n=1, seed=seed)
            seqs.append(Sequence(rid, list(ids), sp, eos_token_ids=self.tokenizer.eos_token_ids,
                                 cache_salt=cache_salt))
        first = seqs[0]
        first.forks = seqs[1:]
        waiting = grammar is not None and not grammar.done()
        if grammar is not None and not waiting:
            compiled = grammar.result()
            for seq in seqs:
                seq.grammar = GrammarState(self.grammar.matcher(compiled), self.model_config.vocab_size)
        if params.prompt_logprobs is not None or waiting:  # scored / compiled first; queued after that
            if not self.cache.can_ever_fit(first):
                raise RequestTooLong(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs more KV "
                                     f"blocks than the cache has", param="max_tokens", value=params.max_tokens)
        else:
            self.scheduler.add(first)  # may raise RequestTooLong (can never fit the cache)
        reqs = [RequestState(seq, IncrementalDetokenizer(self.tokenizer, ids, params.stop),
                             asyncio.Queue() if sink is None else sink, index=i) for i, seq in enumerate(seqs)]
        for req in reqs:
            req.samples = reqs
            self._requests[req.request_id] = req
            if params.timeout_s is not None:
                heapq.heappush(self._deadlines, (req.seq.arrival_time + params.timeout_s, req.seq.seq_id,
                                                 req.request_id))
        if waiting:
            assert grammar is not None
            loop = asyncio.get_running_loop()
            grammar.add_done_callback(lambda f: loop.call_soon_threadsafe(self._grammar_ready, reqs, f))
        elif params.prompt_logprobs is not None:
            self._scoring.append(reqs[0])
        self.counters.prompt_tokens += len(ids)  # once: the samples share the prompt
        self._wakeup.set()
        return reqs[0]

    def _adapter_params(self, params: SamplingParams) -> SamplingParams:
        """A request naming an adapter: the adapter must be served (ClientError naming
        ``adapter``: status 404), and a decoder that drafts with a second model steps aside
        (its draft has no adapter): named, it is refused; by default the request decodes
        with ``standard``."""
        name = params.adapter
        if name not in self._adapters or name in self._unloading:
            known = ", ".join(sorted(set(self._adapters) - self._unloading)) or "none"
            raise NotFound(f"adapter {name!r} is not loaded (adapters served: {known})", param="adapter", value=name)
        if self._max_loras:
            live = {r.seq.params.adapter for r in self._requests.values()} - {None}
            if name not in live and len(live) >= self._max_loras:
                raise AdaptersBusy(f"adapter {name!r} must wait: {len(live)} adapters are in use by running requests "
                                   f"and a step mixes at most max_loras = {self._max_loras}", retry_after_ms=1000)
        decoder = params.decoder or self.config.decoder.name
        if decoder in self._draft_decoders:
            if params.decoder is not None:
                raise ClientError(f"decoder {decoder!r} drafts with a second model, which has no adapter: an adapter "
                                  f"request decodes with standard, ngram or medusa", param="decoder", value=decoder)
            params = msgspec.structs.replace(params, decoder="standard")
        return params

    def adapters(self) -> list[AdapterInfo]:
        """The adapters this engine serves (not those being unloaded)."""
        return [a for n, a in self._adapters.items() if n not in self._unloading]

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load an adapter at run time (every rank, on the step thread between steps);
        ConfigError (naming what is wrong) or ClientError when the name is taken."""
        if not isinstance(name, str) or not 0 < len(name) <= 256 or name in (self.model_name, self.config.engine.model):
            raise ClientError.bad_value("lora_name", name, "a name of 1 to 256 characters other than the base model's")
        async with self._adapter_lock:
            if name in self._adapters:
                raise ClientError(f"adapter {name!r} is already loaded", param="lora_name", value=name)
            loop = asyncio.get_running_loop()
            info = await loop.run_in_executor(self._step_thread, self.executor.load_adapter, name, path)
            self._adapters = {a.name: a for a in await loop.run_in_executor(self._step_thread, self.executor.adapters)}
            return info

    async def unload_adapter(self, name: str) -> None:
        """Stop taking requests for ``name``, wait for the live ones using it to end, then
        free it on every rank. ClientError (404) when it is not loaded."""
        async with self._adapter_lock:
            if name not in self._adapters or name in self._unloading:
                raise NotFound(f"adapter {name!r} is not loaded", param="lora_name", value=name)
            self._unloading.add(name)
            try:
                while any(r.seq.params.adapter == name for r in self._requests.values()):
                    await asyncio.sleep(0.02)
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._step_thread, self.executor.unload_adapter, name)
                self._adapters = {a.name: a for a in
                                  await loop.run_in_executor(self._step_thread, self.executor.adapters)}
            finally:
                self._unloading.discard(name)

    async def submit_async(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                           cache_salt: str | None = None) -> RequestState:
        """A server's way in (the gateway's): :meth:`submit` here; across a process boundary
        (core/engine_process.py) it waits for the core to accept or refuse. A constrained
        request waits here for its grammar (compiled off the event loop), so that a
        constraint that does not compile is refused (a ClientError naming its parameter)."""
        if params.constraint is not None:
            params.validate(self.model_config.vocab_size)
            await self.wait_for_grammar(params.constraint)
        return self.submit(prompt_ids, params, request_id=request_id, cache_salt=cache_salt)

    async def wait_for_grammar(self, constraint: Constraint) -> None:
        """Compile ``constraint`` (on the grammar thread) unless it is cached; raises its
        ClientError when it does not compile. A later :meth:`submit` finds it ready."""
        await asyncio.wrap_future(self._grammar_future(constraint))

    def _grammar_future(self, constraint: Constraint) -> Future:
        """The compile of ``constraint`` (started now on the grammar thread, or the cached one)."""
        key = msgspec.json.encode(constraint)
        fut = self._grammars.get(key)
        if fut is None:
            fut = self._grammar_pool.submit(self.grammar.compile, constraint)
            self._grammars[key] = fut
            while len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return fut

    def _grammar_ready(self, reqs: list[RequestState], fut: Future) -> None:
        """On the event loop: the grammar a submitted request waited for has compiled (or
        failed: its samples end with the error, naming the parameter). Each live sample gets
        its matcher; the first is queued (scored first with prompt_logprobs) carrying the rest
        as its forks."""
        live = [r for r in reqs if self._live(r.seq)]
        if not live:
            return
        try:
            compiled = fut.result()
        except Exception as exc:
            error = str(exc) if isinstance(exc, ClientError) else f"grammar compile failed: {type(exc).__name__}: {exc}"
            for r in live:
                self._end_early(r, SequenceStatus.FINISHED_ERROR, error=error)
            return
        for r in live:
            r.seq.grammar = GrammarState(self.grammar.matcher(compiled), self.model_config.vocab_size)
        head = live[0]
        head.seq.forks = [r.seq for r in live[1:]]
        if head.seq.params.prompt_logprobs is not None:
            self._scoring.append(head)
        else:
            try:
                self.scheduler.add(head.seq)
            except ClientError as exc:
                for r in live:
                    self._end_early(r, SequenceStatus.FINISHED_ERROR, error=str(exc))
                return
        self._wakeup.set()

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
        """Submit and stream. With ``params.n > 1`` the samples' items come interleaved as
        they are produced (each names its sample's request id; a ``Finished`` its
        ``index``), until all n have finished."""
        if params is None or params.n == 1:
            req = self.submit(prompt, params, messages=messages, request_id=request_id, cache_salt=cache_salt)
            async for item in self.stream(req):
                yield item
            return
        queue: asyncio.Queue = asyncio.Queue()
        req = self.submit(prompt, params, messages=messages, request_id=request_id, cache_salt=cache_salt,
                          sink=queue)
        left = len(req.samples)
        try:
            while left:
                item = await queue.get()
                left -= isinstance(item, Finished)
                yield item
        finally:
            for sample in req.samples:
                if not sample.done:
                    self.abort(sample.request_id)

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
                if self._scoring:
                    self._publish()
                    await self._score_prompts(loop)
                if not self.scheduler.has_unfinished():
                    self._publish()
                    if self._scoring:  # waiting for KV blocks, or for owed copies to run
                        await asyncio.sleep(0.001)
                        continue
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                batch = self.scheduler.schedule()
                if batch.is_empty:
                    self._owed_copies.extend(batch.copies)  # run with the next batch that runs
                    self._publish()
                    await asyncio.sleep(0.001)
                    continue
                if self._owed_copies:
                    batch.copies = self._owed_copies + batch.copies
                    self._owed_copies = []
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
        now; tokens it already committed are published first. A sample still waiting to
        fork leaves its first sample's list; a first sample that ends before its forks
        were made hands them on (:meth:`_promote_forks`)."""
        pending = self._pending.pop(req.seq.request_id, None)
        if pending is not None:
            self._publish_one(pending)
            if req.done:
                return
        seq = req.seq
        for sample in req.samples:
            if seq in sample.seq.forks:
                sample.seq.forks.remove(seq)
        self.scheduler.abort(seq.request_id)
        self.decoder.release(seq)
        self._finish(req, status, error)
        if seq.forks:
            self._promote_forks(seq)

    def _promote_forks(self, seq: Sequence) -> None:
        """``seq`` ended before its prefill gave its forks their first tokens: the first
        fork still running prefills for itself and carries the rest."""
        forks, seq.forks = [f for f in seq.forks if self._live(f)], []
        if not forks or (seq.params.constraint is not None and seq.grammar is None):
            return  # (none left, or still waiting for their grammar: _grammar_ready queues them)
        head = forks[0]
        head.forks = forks[1:]
        try:
            self.scheduler.add(head)
        except ClientError as exc:  # the same prompt fitted before; kept for a scheduler that says otherwise
            self._end_early(self._requests[head.request_id], SequenceStatus.FINISHED_ERROR, error=str(exc))

    def _live(self, seq: Sequence) -> bool:
        req = self._requests.get(seq.request_id)
        return req is not None and req.seq is seq and not req.done and req.ending is None

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
            if seq.grammar is not None and seq.grammar.dead_end:
                constraint = seq.params.constraint
                self._end_early(req, SequenceStatus.FINISHED_ERROR, error=(
                    f"{constraint.param if constraint else 'constraint'}: the grammar allows no token of this "
                    f"model's vocabulary after {seq.num_output_tokens} output tokens"))
                continue
            if seq.forks:  # its prefill is done: the request's other samples fork from it now
                generated += self._fork_samples(seq, out, now)
            status, taken = self._take_tokens(req, res)
            generated += taken
            if status is not None:
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

    def _take_tokens(self, req: RequestState, res) -> tuple[SequenceStatus | None, int]:
        """Append a step's tokens to ``req``'s sequence up to a stop; queue them for
        :meth:`_publish`. Returns (the stop, if it stops: ``req.ending`` is set), tokens taken)."""
        seq = req.seq
        status, accepted = None, []
        grammar = seq.grammar
        for tok in res.token_ids:
            seq.append_token(tok)
            accepted.append(tok)
            if grammar is not None:
                grammar.accept(tok)
            status = req.check_stop(tok, self.max_model_len, detokenize=req.detok.needs_text)
            if status is None and grammar is not None and grammar.terminated:
                status = SequenceStatus.FINISHED_STOPPED  # the grammar is complete (it took a stop token)
            if status is not None:
                break
        # A stop inside the accepted drafts appends fewer tokens than were computed: KV
        # exists only for tokens the sequence has (a prefix cache registers up to here).
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
        req.num_drafted += res.num_drafted
        req.num_accepted += res.num_accepted
        if res.num_drafted:
            by = res.drafted_by or seq.params.decoder or self.config.decoder.name
            req.drafted_by[by] = req.drafted_by.get(by, 0) + res.num_drafted
        earlier = self._pending.pop(seq.request_id, None)
        if earlier is not None:  # (the loop publishes before every commit: kept in order regardless)
            self._publish_one(earlier)
        self._pending[seq.request_id] = _Pending(req, accepted, res.logprobs[:len(accepted)] if res.logprobs
                                                 else None, status)
        if status is not None:
            req.ending = status
        return status, len(accepted)

    def _fork_samples(self, parent: Sequence, out: DecoderOutput, now: float) -> int:
        """``parent`` (sample 0 of an ``n > 1`` request, or the first still running) sampled
        its first token this step, and the decoder drew each fork's first token from the same
        row (``out[fork]``). Each fork takes that token, then ``CacheManager.fork`` gives it
        the prompt's KV (full blocks shared, the last partial block copied before the next
        step) and it joins the scheduler to decode on its own. A fork with no token from the
        decoder gets the prompt's KV less its last token, which it then computes itself; a
        fork that stops on its first token never holds a block. Returns the tokens taken."""
        forks, parent.forks = parent.forks, []
        taken = 0
        for child in forks:
            if not self._live(child):
                continue
            req = self._requests[child.request_id]
            req.timer.on_scheduled(now)
            res = out.get(child)
            if res is not None and res.token_ids:
                status, n = self._take_tokens(req, res)
                taken += n
                if status is not None:
                    self.decoder.release(child)
                    continue
            child.num_computed_tokens = self.cache.fork(parent, child)
            try:
                self.scheduler.add(child)
            except ClientError as exc:  # the same prompt fitted: kept for a scheduler that says otherwise
                self.cache.free(child)
                self._end_early(req, SequenceStatus.FINISHED_ERROR, error=str(exc))
        return taken

    # ---- prompt logprobs (SamplingParams.prompt_logprobs) ------------------------------------
    async def _score_prompts(self, loop) -> None:
        """Score the prompts of requests that asked for ``prompt_logprobs`` (one prefill
        each on scratch blocks, as ``tokenloom eval perplexity`` scores text: core/evaluation.py),
        then queue them (or, with ``max_tokens=0``, finish them). A request waits while
        the pool lacks the blocks, and while KV copies a fork owes have not run yet (the
        scratch prefill must not write a block before it is copied)."""
        self._owed_copies.extend(self.cache.take_copies())
        while self._scoring and not self._owed_copies:
            req = self._scoring[0]
            if req.done or req.ending is not None:
                self._scoring.popleft()
                continue
            seq = req.seq
            ids = seq.token_ids[:seq.num_prompt_tokens]
            scratch = Sequence("prompt-logprobs", list(ids), SamplingParams(max_tokens=1))
            if not self.cache.allocate(scratch, len(ids)):
                self.cache.free(scratch)
                return
            table = list(self.cache.block_table(scratch))
            k = seq.params.prompt_logprobs or 0
            try:
                scored = await loop.run_in_executor(self._step_thread, self._score, ids, table, k,
                                                    seq.params.adapter)
            finally:
                self.cache.free(scratch)
            self._scoring.popleft()
            if req.done or req.ending is not None:  # ended while it was scored
                continue
            req.emit_prompt_logprobs([None] + [TokenLogprobs(token_id=t, logprob=lp, top=[Logprob(a, b) for a, b in top])
                                               for t, (lp, top) in zip(ids[1:], scored, strict=True)])
            if seq.params.max_tokens == 0:  # scoring alone: nothing to generate
                for sample in req.samples:
                    if not sample.done:
                        self.decoder.release(sample.seq)
                        self._finish(sample, SequenceStatus.FINISHED_LENGTH)
                continue
            try:
                self.scheduler.add(seq)
            except ClientError as exc:
                self._end_early(req, SequenceStatus.FINISHED_ERROR, error=str(exc))

    def _score(self, ids: list[int], table: list[int], top: int, adapter: str | None = None) -> list:
        """On the step thread: one prompt's logprobs (core/evaluation.py's scoring)."""
        from tokenloom.core.evaluation import prompt_logprobs

        logits = self.executor.prefill_logits(ids, table, adapter)
        assert logits is not None  # rank 0's (the executor returns rank 0's)
        return prompt_logprobs(logits, ids, top)

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
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)


@dataclass(slots=True)
class _Pending:
    """One request's committed, unpublished part of a step."""

    req: RequestState
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token, when the request asked for them
    status: SequenceStatus | None


def _r(x: float | None) -> float | None:
    return round(x, 2) if x is not None else None

