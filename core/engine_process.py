"""The engine core in its own process (``engine.process = "separate"``, `tokenloom serve`'s
default): the server keeps HTTP, WebSocket frames, JSON/SSE and tokenising; the core
process runs the step loop (scheduling, the model step, detokenising, stop strings) with
the GIL to itself, as vLLM v1's engine core and SGLang's scheduler process do.

Wire: one AF_UNIX socket pair, frames of a 4-byte length and a msgpack body (msgspec).
The frontend sends :class:`Submit`, :class:`Abort`, :class:`StatsQuery`,
:class:`LoadAdapter`, :class:`UnloadAdapter` and :class:`Shutdown`; the core answers with one
:class:`Outputs` per turn of its event loop — in practice one per engine step — carrying
every request's new deltas and Finisheds, which requests it accepted or refused, and its
health when that changed. Nothing the core does waits on a client: the frontend reads every
frame at once and queues the deltas per request.

Adapters (``--lora``): the client keeps the core's adapter list — sent with Ready, with
every :class:`AdapterReply` (a load's or an unload's outcome: the exception pickled, as a
refused Submit's) and with every :class:`StatsReply` — so that :meth:`EngineClient.adapters`,
which the OpenAI frontend reads on every request, answers without a round trip. An unload
takes its adapter off that list at once, as in-process. The adapters loaded or unloaded at
run time are carried over a core restart: the new core loads the start-up set, and the
client then loads and unloads to bring it back to the set the last successful calls left.

Failure policy (as in-process, core/health.py): a failed step is handled inside the core
(every request in flight ends with an error, the loop restarts after a back-off); the core
process itself dying — killed, out of memory, a crash in native code — is seen at once as
the end of its socket: every unfinished request ends with ``finish_reason="error"``, the
failure counts towards ``max_restarts``, and the client starts a new core (``/health``
says ``restarting`` until it has loaded) or, past the limit, reports ``dead`` so that
`tokenloom serve` exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import structlog

from tokenloom.core.config import EngineConfig
from tokenloom.core.errors import ClientError, EngineUnavailable, NotFound
from tokenloom.core.health import EngineHealth, HealthReport
from tokenloom.core.inputs import check_length, encode_prompt, refuse_by_size
from tokenloom.core.interfaces import AdapterInfo
from tokenloom.core.models.config import ModelConfig
from tokenloom.core.outputs import (
    Finished,
    RequestMetrics,
    TokenDelta,
    Usage,
    stream_request,
)
from tokenloom.core.plugins import PluginManager
from tokenloom.core.requests import sample_request_ids
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.tokenizer import Tokenizer

log = structlog.get_logger("tokenloom.engine_process")

_HEADER = struct.Struct("!I")
STARTUP_TIMEOUT_S = 600.0  # loading a model (and measuring kernels) in the new core


# ---- messages ---------------------------------------------------------------------------
class Submit(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class StatsQuery(msgspec.Struct, tag=True, array_like=True):
    call_id: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class LoadAdapter(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    name: str
    path: str


class UnloadAdapter(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    name: str


class Refusal(msgspec.Struct, array_like=True):
    request_id: str
    error: bytes  # the pickled exception submit raised (ClientError, EngineUnavailable, ...)


class HealthState(msgspec.Struct, array_like=True):
    failures: int
    consecutive: int
    dead: bool
    retry_at: float  # time.monotonic() (CLOCK_MONOTONIC: one clock for every process)
    last_error: str | None
    steps: int  # steps run by this core (a core that dies before its first counts as a failure in a row)


class Outputs(msgspec.Struct, tag=True, array_like=True):
    accepted: list[str] = msgspec.field(default_factory=list)
    refused: list[Refusal] = msgspec.field(default_factory=list)
    deltas: list[TokenDelta] = msgspec.field(default_factory=list)
    finished: list[Finished] = msgspec.field(default_factory=list)  # after the deltas: a request's last
    health: HealthState | None = None


class StatsReply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    stats: dict
    block_map: str
    adapters: list[AdapterInfo] = msgspec.field(default_factory=list)  # the core's, as of this reply


class AdapterReply(msgspec.Struct, tag=True, array_like=True):
    """A LoadAdapter's or UnloadAdapter's outcome, and the core's adapters after it."""

    call_id: int
    adapters: list[AdapterInfo]
    info: AdapterInfo | None = None  # what load_adapter returned
    error: bytes | None = None  # the pickled exception it raised (ClientError, NotFound, ConfigError, ...)


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: bytes  # pickled EngineInfo


class StartFailed(msgspec.Struct, tag=True, array_like=True):
    error: bytes  # the pickled exception


ToCore = Submit | Abort | StatsQuery | LoadAdapter | UnloadAdapter | Shutdown
ToFrontend = Outputs | StatsReply | AdapterReply | Ready | StartFailed


@dataclass(slots=True)
class EngineInfo:
    """What the frontend needs of the loaded engine (sent once, pickled)."""

    tokenizer: Tokenizer
    model_config: ModelConfig
    model_name: str
    max_model_len: int
    kv_capacity_tokens: int
    pid: int
    adapters: list[AdapterInfo] = field(default_factory=list)  # those served at start-up


class _Channel:
    """Length-prefixed msgpack frames over an asyncio stream; writes never block (the
    transport buffers)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, decode_type):
        self.reader, self.writer = reader, writer
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(decode_type)

    @classmethod
    async def open(cls, sock: socket.socket, decode_type) -> _Channel:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=1 << 24)
        return cls(reader, writer, decode_type)

    def send(self, msg) -> None:
        body = self.encoder.encode(msg)
        self.writer.write(_HEADER.pack(len(body)) + body)

    async def recv(self):
        (n,) = _HEADER.unpack(await self.reader.readexactly(_HEADER.size))
        return self.decoder.decode(await self.reader.readexactly(n))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


# ---- the core process ---------------------------------------------------------------------
class _Outbox:
    """Collects what the engine emits during one turn of the core's event loop and sends it
    as one Outputs frame (flushed by a callback scheduled on the first item)."""

    def __init__(self, channel: _Channel, engine):
        self.channel, self.engine = channel, engine
        self.out = Outputs()
        self.scheduled = False
        self.sent_health: tuple | None = None

    def _schedule(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def put_nowait(self, item: TokenDelta | Finished) -> None:  # the Sink every request writes to
        if isinstance(item, TokenDelta):
            self.out.deltas.append(item)
        else:
            self.out.finished.append(item)
        self._schedule()

    def accepted(self, request_id: str) -> None:
        self.out.accepted.append(request_id)
        self._schedule()

    def refused(self, request_id: str, exc: BaseException) -> None:
        self.out.refused.append(Refusal(request_id, _pickle_error(exc)))
        self._schedule()

    def flush(self) -> None:
        self.scheduled = False
        h = self.engine.health
        health = (h.failures, h.consecutive, h.dead, h.retry_at, h.last_error, min(self.engine.counters.steps, 1))
        if health != self.sent_health:
            self.sent_health = health
            self.out.health = HealthState(*health)
        self.channel.send(self.out)
        self.out = Outputs()


def _pickle_error(exc: BaseException) -> bytes:
    """The exception itself when it survives pickling, else a ServerError with its text."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:
        from tokenloom.core.errors import ConfigError, ServerError

        kind = ConfigError if isinstance(exc, ValueError) else ServerError
        return pickle.dumps(kind(f"{type(exc).__name__}: {exc}"))


def core_main(conn, config: EngineConfig, log_level: str, show_progress: bool) -> None:
    """The core process's entry point (multiprocessing, spawn)."""
    # The server owns Ctrl-C and SIGTERM: it drains, then tells the core to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from tokenloom.core.logging import configure_logging

    configure_logging(log_level)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    conn.close()
    asyncio.run(_serve_core(sock, config, show_progress))


async def _serve_core(sock: socket.socket, config: EngineConfig, show_progress: bool) -> None:
    from tokenloom.core.engine import AsyncEngine

    channel = await _Channel.open(sock, ToCore)
    try:
        progress = None
        if show_progress:
            from tokenloom.cli.args import progress_bar

            progress = progress_bar("loading model")
        engine = AsyncEngine(config, plugin_manager=PluginManager(), progress=progress)
    except BaseException as exc:
        channel.send(StartFailed(_pickle_error(exc)))
        await channel.writer.drain()
        channel.close()
        return
    info = EngineInfo(engine.tokenizer, engine.model_config, engine.model_name, engine.max_model_len,
                      engine.kv_capacity_tokens, os.getpid(), engine.adapters())
    channel.send(Ready(pickle.dumps(info)))
    outbox = _Outbox(channel, engine)
    compiling: dict[str, bool] = {}  # constrained requests waiting for their grammar: aborted meanwhile?
    tasks: set[asyncio.Task] = set()
    try:
        while True:
            try:
                msg = await channel.recv()
            except (asyncio.IncompleteReadError, ConnectionError):
                break  # the server is gone: stop
            if isinstance(msg, Submit):
                if msg.params.constraint is not None:  # waits for its grammar (compiled off this loop) first
                    compiling[msg.request_id] = False
                    tasks.add(t := asyncio.get_running_loop().create_task(_submit(engine, msg, outbox, compiling)))
                    t.add_done_callback(tasks.discard)
                else:
                    _submit_now(engine, msg, outbox)
            elif isinstance(msg, Abort):
                for rid in msg.request_ids:
                    if rid in compiling:
                        compiling[rid] = True  # aborted while its grammar compiles: aborted once submitted
                    engine.abort(rid)
            elif isinstance(msg, StatsQuery):
                channel.send(StatsReply(msg.call_id, {**engine.stats(), **_memory("engine_")}, engine.kv_block_map(),
                                        engine.adapters()))
            elif isinstance(msg, LoadAdapter | UnloadAdapter):  # (an unload waits for its requests to end)
                tasks.add(t := asyncio.get_running_loop().create_task(_adapter_call(engine, msg, outbox)))
                t.add_done_callback(tasks.discard)
            elif isinstance(msg, Shutdown):
                break
    finally:
        await engine.shutdown()
        if outbox.scheduled:
            outbox.flush()
        with contextlib.suppress(Exception):
            await channel.writer.drain()
        engine.close()
        channel.close()


def _submit_now(engine, msg: Submit, outbox: _Outbox) -> bool:
    try:
        engine.submit(msg.prompt_ids, msg.params, request_id=msg.request_id, cache_salt=msg.cache_salt, sink=outbox)
    except Exception as exc:  # ClientError, EngineUnavailable, RequestTooLong
        outbox.refused(msg.request_id, exc)
        return False
    outbox.accepted(msg.request_id)
    return True


async def _submit(engine, msg: Submit, outbox: _Outbox, compiling: dict[str, bool]) -> None:
    """A constrained request: its grammar compiles first (a constraint that does not compile
    is refused, naming its parameter, like any bad parameter), then it is submitted."""
    try:
        assert msg.params.constraint is not None
        await engine.wait_for_grammar(msg.params.constraint)
    except Exception as exc:
        compiling.pop(msg.request_id, None)
        outbox.refused(msg.request_id, exc)
        return
    if _submit_now(engine, msg, outbox) and compiling.get(msg.request_id):
        engine.abort(msg.request_id)
    compiling.pop(msg.request_id, None)


async def _adapter_call(engine, msg: LoadAdapter | UnloadAdapter, outbox: _Outbox) -> None:
    """Run a load or unload on the engine; answer with its outcome and the adapters after it
    (sent after the Outputs pending now: an unload's requests have ended before its reply)."""
    info, error = None, None
    try:
        if isinstance(msg, LoadAdapter):
            info = await engine.load_adapter(msg.name, msg.path)
        else:
            await engine.unload_adapter(msg.name)
    except Exception as exc:  # ClientError (name taken), NotFound, ConfigError (the files), ...
        error = _pickle_error(exc)
    if outbox.scheduled:
        outbox.flush()
    outbox.channel.send(AdapterReply(msg.call_id, engine.adapters(), info, error))


def _memory(prefix: str) -> dict[str, int]:
    from tokenloom.protocols.metrics import process_memory

    return {prefix + k: v for k, v in process_memory().items()}


# ---- the frontend's side ------------------------------------------------------------------------
@dataclass(eq=False, slots=True)
class RemoteRequest:
    """A request submitted to the core: the stream its frontend reads."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False
    accepted: asyncio.Future | None = None
    index: int = 0  # which sample of its request (SamplingParams.n)
    samples: list[RemoteRequest] = field(default_factory=list)  # all of them, this one included
    prompt_token_ids: list[int] = field(default_factory=list)


class CoreDied(Exception):
    pass


class EngineClient:
    """The AsyncEngine surface a server uses (submit, stream, abort, stats, health, adapters),
    with the engine core in a process of its own. Construct with :meth:`start` (it waits for
    the core to load the model)."""

    def __init__(self, config: EngineConfig, plugin_manager: PluginManager, info: EngineInfo, *,
                 log_level: str = "INFO", show_progress: bool = False):
        self.config, self.pm = config, plugin_manager
        self._adapters: dict[str, AdapterInfo] = {}  # the core's, as of its last word on them
        self._unloading: set[str] = set()  # unloads sent, not yet answered: no new request for them
        self._set_info(info)
        # the adapters the last successful load/unload calls left (name -> path): a new core
        # after a restart is brought back to them
        self._wanted: dict[str, str] = {a.name: a.path for a in info.adapters}
        self._adapter_calls: dict[int, asyncio.Future] = {}
        self.log_level, self.show_progress = log_level, show_progress
        self.health = EngineHealth(config.engine.max_restarts, config.engine.restart_backoff_s)
        self.dead_event = asyncio.Event()
        self._requests: dict[str, RemoteRequest] = {}
        self._stats: dict = {}
        self._block_map = ""
        self._stats_calls: dict[int, asyncio.Future] = {}
        self._next_call = 0
        self._channel: _Channel | None = None
        self._process = None
        self._reader: asyncio.Task | None = None
        self._restarting: asyncio.Task | None = None
        self._closing = False
        self._deaths = self._deaths_in_a_row = 0  # core processes lost (all, and since the last step)

    def _set_info(self, info: EngineInfo) -> None:
        self.tokenizer = info.tokenizer
        self.model_config = info.model_config
        self.model_name, self.max_model_len = info.model_name, info.max_model_len
        self.kv_capacity_tokens = info.kv_capacity_tokens
        self.core_pid = info.pid
        self._adapters = {a.name: a for a in info.adapters}

    @classmethod
    async def start(cls, config: EngineConfig, plugin_manager: PluginManager | None = None, *,
                    log_level: str = "INFO", show_progress: bool = False) -> EngineClient:
        process, channel, info = await _spawn(config, log_level, show_progress)
        client = cls(config, plugin_manager or PluginManager(), info, log_level=log_level, show_progress=show_progress)
        client._attach(process, channel)
        return client

    def _attach(self, process, channel: _Channel) -> None:
        self._process, self._channel = process, channel
        self._reader = asyncio.get_running_loop().create_task(self._read(channel, process), name="tokenloom-core-reader")

    # ---- the AsyncEngine surface ---------------------------------------------------------
    def prompt_ids(self, prompt=None, messages=None, parse_special_tokens: bool | None = None,
                   tools: list[dict] | None = None) -> list[int]:
        refuse_by_size(self.tokenizer, self.max_model_len, prompt, messages)
        return encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt, messages,
                             parse_special_tokens=parse_special_tokens, tools=tools)

    async def prompt_ids_async(self, prompt=None, messages=None, parse_special_tokens: bool | None = None,
                               tools: list[dict] | None = None) -> list[int]:
        if prompt is not None and not isinstance(prompt, str):
            return self.prompt_ids(prompt, messages, parse_special_tokens)
        refuse_by_size(self.tokenizer, self.max_model_len, prompt, messages)
        return await asyncio.to_thread(self.prompt_ids, prompt, messages, parse_special_tokens, tools)

    async def submit_async(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                           cache_salt: str | None = None) -> RemoteRequest:
        """Send the request and wait for the core to take it (or raise what it raised:
        ClientError naming the parameter, EngineUnavailable)."""
        self.health.check(time.monotonic())
        if self._channel is None:
            raise EngineUnavailable("the engine core is starting", retry_after_ms=1000)
        params.validate(self.model_config.vocab_size)  # n among them, before it makes n requests here
        rids = sample_request_ids(request_id, params.n)
        for rid in rids:
            if rid in self._requests:
                raise ClientError(f"request id {rid!r} is already in use", param="request_id", value=request_id)
        check_length(len(prompt_ids), params.max_tokens, self.max_model_len)  # before a huge int meets msgpack
        # every sample's stream exists before the core can answer for it (the core submits
        # all n at once: core/engine.py)
        reqs = [RemoteRequest(rid, index=i, prompt_token_ids=list(prompt_ids)) for i, rid in enumerate(rids)]
        req = reqs[0]
        req.accepted = asyncio.get_running_loop().create_future()
        for r in reqs:
            r.samples = reqs
            self._requests[r.request_id] = r
        self._channel.send(Submit(request_id, list(prompt_ids), params, cache_salt))
        try:
            await req.accepted
        except BaseException:
            for r in reqs:
                if self._requests.get(r.request_id) is r and not r.done:
                    del self._requests[r.request_id]
            if self._channel is not None:  # cancelled while waiting: the core may have taken it
                self._channel.send(Abort(rids))
            raise
        return req

    async def generate(self, prompt=None, params: SamplingParams | None = None, *, messages=None,
                       request_id: str | None = None, cache_salt: str | None = None
                       ) -> AsyncIterator[TokenDelta | Finished]:
        params = params or SamplingParams()
        params.validate(self.model_config.vocab_size)
        ids = await self.prompt_ids_async(prompt, messages)
        req = await self.submit_async(ids, params, request_id=request_id or uuid.uuid4().hex, cache_salt=cache_salt)
        async for item in self.stream(req):
            yield item

    def stream(self, req: RemoteRequest, *, batched: bool = False) -> AsyncIterator:
        """Iterate a submitted request's deltas and its final result; deltas that piled up
        while the reader was busy come as one. ``batched``: lists of what is ready at once
        (see :func:`~tokenloom.core.outputs.read_ready`). Leaving early aborts it."""
        return stream_request(req, self.abort, batched=batched)

    def abort(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        if req is None or req.done or self._channel is None:
            return False
        self._channel.send(Abort([request_id]))
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    def stats(self) -> dict:
        """The core's numbers as of the last :meth:`refresh_stats`."""
        return dict(self._stats)

    async def refresh_stats(self, timeout_s: float = 5.0) -> None:
        if self._channel is None:
            return
        self._next_call += 1
        call = self._next_call
        fut = self._stats_calls[call] = asyncio.get_running_loop().create_future()
        self._channel.send(StatsQuery(call))
        try:
            reply = await asyncio.wait_for(fut, timeout_s)
            self._stats, self._block_map = reply.stats, reply.block_map
        except (TimeoutError, CoreDied):
            pass
        finally:
            self._stats_calls.pop(call, None)

    def kv_block_map(self) -> str:
        return self._block_map

    # ---- adapters -----------------------------------------------------------------------------
    def adapters(self) -> list[AdapterInfo]:
        """The adapters the core serves (not those being unloaded), without a round trip:
        the list its last reply carried (``resident`` as of then)."""
        return [a for n, a in self._adapters.items() if n not in self._unloading]

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Load an adapter in the core (AsyncEngine.load_adapter's errors, raised here:
        ClientError naming ``lora_name`` when the name is taken or invalid, ConfigError
        naming what is wrong with the files)."""
        if not isinstance(name, str) or not 0 < len(name) <= 256 or name in (self.model_name, self.config.engine.model):
            raise ClientError.bad_value("lora_name", name, "a name of 1 to 256 characters other than the base model's")
        if not isinstance(path, str):
            raise ClientError.bad_value("lora_path", path, "a path (a string)")
        reply = await self._adapter_call(lambda call: LoadAdapter(call, name, path))
        self._wanted[name] = path
        assert reply.info is not None
        return reply.info

    async def unload_adapter(self, name: str) -> None:
        """Stop taking requests for ``name`` at once, and wait for the core to unload it
        (once the live requests using it have ended). NotFound when it is not loaded."""
        if not isinstance(name, str) or name in self._unloading:
            raise NotFound(f"adapter {name!r} is not loaded", param="lora_name", value=name)
        self._unloading.add(name)
        try:
            await self._adapter_call(lambda call: UnloadAdapter(call, name))
            self._wanted.pop(name, None)
        finally:
            self._unloading.discard(name)

    async def _adapter_call(self, make) -> AdapterReply:
        self.health.check(time.monotonic())
        if self._channel is None:
            raise EngineUnavailable("the engine core is starting", retry_after_ms=1000)
        self._next_call += 1
        call = self._next_call
        fut = self._adapter_calls[call] = asyncio.get_running_loop().create_future()
        self._channel.send(make(call))
        try:
            reply: AdapterReply = await fut
        finally:
            self._adapter_calls.pop(call, None)
        if reply.error is not None:
            raise pickle.loads(reply.error)
        return reply

    async def _restore_adapters(self) -> None:
        """After a restart: the new core serves the start-up adapters; load and unload until
        it serves those the last successful calls left. One that fails now is logged and
        dropped (it is not served)."""
        try:
            for name in [n for n in self._adapters if n not in self._wanted]:
                try:
                    await self._adapter_call(lambda call, name=name: UnloadAdapter(call, name))
                except EngineUnavailable:
                    raise
                except Exception as exc:
                    log.error("adapter_restore_failed", adapter=name, action="unload", error=str(exc))
            for name, path in list(self._wanted.items()):
                have = self._adapters.get(name)
                if have is not None and have.path == path:
                    continue
                try:
                    if have is not None:
                        await self._adapter_call(lambda call, name=name: UnloadAdapter(call, name))
                    await self._adapter_call(lambda call, name=name, path=path: LoadAdapter(call, name, path))
                except EngineUnavailable:
                    raise
                except Exception as exc:
                    log.error("adapter_restore_failed", adapter=name, action="load", error=str(exc))
                    self._wanted.pop(name, None)
        except EngineUnavailable:
            pass  # this core died too: the next one is restored in turn

    def health_report(self) -> HealthReport:
        report = self.health.report(time.monotonic())
        if report.status == "ok" and self._channel is None and not self._closing:  # a new core is loading
            return HealthReport("restarting", f"a new engine core is loading after: {self.health.last_error}",
                                1000, report.engine_failures)
        return report

    async def shutdown(self) -> None:
        """Abort what runs and wait for the Finisheds (the core keeps running until close)."""
        for rid in list(self._requests):
            self.abort(rid)
        for _ in range(2000):
            if not self._requests or self._channel is None:
                break
            await asyncio.sleep(0.005)

    async def aclose(self) -> None:
        self._closing = True
        if self._restarting is not None:
            self._restarting.cancel()
        if self._channel is not None:
            self._channel.send(Shutdown())
            with contextlib.suppress(Exception):
                await self._channel.writer.drain()
        process = self._process
        if process is not None:
            await asyncio.to_thread(process.join, 30)
            if process.is_alive():
                process.kill()
                await asyncio.to_thread(process.join, 5)
        if self._reader is not None:
            self._reader.cancel()
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        for fut in self._adapter_calls.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable("the engine is shutting down"))

    # ---- what comes back -------------------------------------------------------------------
    async def _read(self, channel: _Channel, process) -> None:
        try:
            while True:
                msg = await channel.recv()
                if isinstance(msg, Outputs):
                    self._on_outputs(msg)
                elif isinstance(msg, StatsReply):
                    self._adapters = {a.name: a for a in msg.adapters}
                    fut = self._stats_calls.get(msg.call_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif isinstance(msg, AdapterReply):
                    self._adapters = {a.name: a for a in msg.adapters}  # before the caller resumes
                    fut = self._adapter_calls.get(msg.call_id)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            return
        if not self._closing:
            self._on_core_died(process)

    def _on_outputs(self, msg: Outputs) -> None:
        reqs = self._requests
        for rid in msg.accepted:
            req = reqs.get(rid)
            if req is not None and req.accepted is not None and not req.accepted.done():
                req.accepted.set_result(None)
        for refusal in msg.refused:
            req = reqs.pop(refusal.request_id, None)
            if req is not None:
                for sample in req.samples[1:]:  # its other samples were never taken either
                    reqs.pop(sample.request_id, None)
            if req is not None and req.accepted is not None and not req.accepted.done():
                req.accepted.set_exception(pickle.loads(refusal.error))
        for delta in msg.deltas:
            req = reqs.get(delta.request_id)
            if req is not None:
                req.queue.put_nowait(delta)
        for final in msg.finished:
            req = reqs.pop(final.request_id, None)
            if req is not None:
                req.done = True
                req.queue.put_nowait(final)
        if msg.health is not None:  # the core's own count, plus the cores that died
            h = msg.health
            if h.steps:
                self._deaths_in_a_row = 0
            self.health.failures = h.failures + self._deaths
            self.health.consecutive = h.consecutive + self._deaths_in_a_row
            self.health.dead, self.health.retry_at = h.dead, h.retry_at
            if h.last_error is not None:
                self.health.last_error = h.last_error
            if h.dead:
                self.dead_event.set()

    def _on_core_died(self, process) -> None:
        """The core's socket ended: every request ends now, then the restart policy."""
        code = _exit_code(process)
        reason = f"the engine core process exited ({code})"
        log.error("engine_core_died", reason=reason, requests=len(self._requests))
        self._channel = None
        for fut in self._stats_calls.values():
            if not fut.done():
                fut.set_exception(CoreDied(reason))
        for fut in self._adapter_calls.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(reason, retry_after_ms=1000))
        for rid, req in list(self._requests.items()):
            if req.accepted is not None and not req.accepted.done():
                req.accepted.set_exception(EngineUnavailable(reason, retry_after_ms=1000))
            else:
                req.done = True
                req.queue.put_nowait(_error_final(rid, reason, req.index))
        self._requests.clear()
        self._deaths += 1
        self._deaths_in_a_row += 1
        self.health.on_failure(CoreDied(reason), time.monotonic())
        if self.health.dead:
            self.dead_event.set()
            return
        self._restarting = asyncio.get_running_loop().create_task(self._restart(), name="tokenloom-core-restart")

    async def _restart(self) -> None:
        await asyncio.sleep(max(0.0, self.health.retry_at - time.monotonic()))
        try:
            process, channel, info = await _spawn(self.config, self.log_level, False)
        except Exception as exc:
            log.error("engine_core_restart_failed", error=str(exc))
            self.health.on_failure(exc, time.monotonic())
            self.health.dead = True
            self.dead_event.set()
            return
        self._set_info(info)
        # the new core counts from zero: carry the failures seen so far
        self.health.retry_at = 0.0
        log.info("engine_core_restarted", pid=info.pid)
        self._attach(process, channel)
        await self._restore_adapters()


def _exit_code(process) -> str:
    if process is None:
        return "unknown"
    process.join(1.0)
    code = process.exitcode
    if code is None:
        return "still running, its socket closed"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def _error_final(request_id: str, reason: str, index: int = 0) -> Finished:
    return Finished(request_id=request_id, finish_reason="error", text="", token_ids=[],
                    usage=Usage(prompt_tokens=0, cached_tokens=0, completion_tokens=0),
                    metrics=RequestMetrics(ttft_ms=None, tpot_ms=None, e2e_ms=0.0, queue_ms=None), error=reason,
                    index=index)


async def _spawn(config: EngineConfig, log_level: str, show_progress: bool):
    """Start a core process and wait until it has loaded the model: (process, channel, info);
    what failed at its start-up is raised here (ConfigError, ...)."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    # the frontends' options stay here: the core never reads them (and a third-party
    # frontend's options class need not be importable there)
    core_config = dataclasses.replace(config, frontends=[])
    process = ctx.Process(target=core_main, args=(theirs, core_config, log_level, show_progress),
                          name="tokenloom-engine-core", daemon=True)
    process.start()
    theirs.close()
    sock = socket.socket(fileno=os.dup(ours.fileno()))
    ours.close()
    channel = await _Channel.open(sock, ToFrontend)
    try:
        msg = await asyncio.wait_for(channel.recv(), STARTUP_TIMEOUT_S)
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
        channel.close()
        process.kill()
        raise EngineUnavailable(f"the engine core process failed to start ({_exit_code(process)})") from None
    if isinstance(msg, StartFailed):
        channel.close()
        await asyncio.to_thread(process.join, 10)
        raise pickle.loads(msg.error)
    assert isinstance(msg, Ready)
    return process, channel, pickle.loads(msg.info)
