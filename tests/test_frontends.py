"""The frontend role: a third-party frontend mounted beside the built-in ones, one set of
rules (queue, rate limits) across all of them, and one shutdown."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import msgspec
import pytest

from tokenloom.core.build import config_from_sources
from tokenloom.core.engine import AsyncEngine
from tokenloom.core.engine_process import EngineClient
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import Frontend
from tokenloom.core.outputs import Finished
from tokenloom.core.plugins import PluginManager
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.protocols.gateway import FrontendHost, RateLimited, Refused, ServerOptions
from tokenloom.protocols.ratelimit import RateLimiter, RateLimits

from conftest import SEPARATE, SlowSteps, engine_stats, tiny_engine_kwargs, wait_idle

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


class LineOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int = 8


class LineFrontend:
    """A toy protocol over TCP: one prompt per line in, the generated text and its finish
    reason out as one JSON line. What a third-party frontend needs, and no more."""

    name = "line"

    def __init__(self, options: LineOptions, context):
        self.options, self.engine, self.gateway, self.host = options, context.engine, context.gateway, context.host
        self.server = None
        self.running: set[str] = set()  # engine ids of requests being answered
        self.finals: list[str] = []

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._client, self.host, 0)

    def urls(self) -> list[str]:
        return [f"tcp://{self.host}:{self.server.sockets[0].getsockname()[1]}"]

    def stop_accepting(self) -> None:
        self.server.close()

    async def close(self) -> None:
        for rid in list(self.running):  # each still gets its answer line, as `aborted`
            self.engine.abort(rid)
        while self.running:
            await asyncio.sleep(0.005)

    async def _client(self, reader, writer) -> None:
        limiter = RateLimiter(self.gateway.options.rate_limits)
        async for line in reader:
            try:
                self.gateway.reserve()
                try:
                    self.gateway.take_request(limiter)
                except RateLimited:
                    self.gateway.release()
                    raise
                params = SamplingParams(max_tokens=self.options.max_tokens, ignore_eos=True)
                req = await self.gateway.admit(params=params, limiter=limiter, request_id=f"line-{id(line)}",
                                               prompt=line.decode(), reserved=True)
            except (Refused, RateLimited) as exc:
                writer.write(json.dumps({"error": type(exc).__name__}).encode() + b"\n")
                continue
            self.running.add(req.request_id)
            async for item in self.engine.stream(req):
                if isinstance(item, Finished):
                    self.finals.append(item.finish_reason)
                    writer.write(json.dumps({"text": item.text, "finish_reason": item.finish_reason}).encode() + b"\n")
            self.running.discard(req.request_id)
            await writer.drain()
        writer.close()


class LinePlugin:
    @hookimpl
    def register_frontends(self, register):
        register("line", LineFrontend, options=LineOptions)


@pytest.fixture
async def host_factory(tiny_model_dir):
    made = []

    async def make(frontends: dict, slow: bool = False, **server_options):
        pm = PluginManager(load_entry_points=False, extra=[LinePlugin(), *([SlowSteps()] if slow else [])])
        config = config_from_sources(pm, None, None, tiny_engine_kwargs(tiny_model_dir, frontends=frontends))
        if SEPARATE and not slow:  # (SlowSteps is an engine plugin object: it stays in this process)
            engine = await EngineClient.start(config, pm, log_level="WARNING")
        else:
            engine = AsyncEngine(config, plugin_manager=pm)
        host = FrontendHost(engine, ServerOptions(**server_options))
        await host.start()
        made.append(host)
        return host, {f.name: f for f in host.frontends}

    yield make
    for host in made:
        await host.shutdown(0)
        await host.engine.shutdown()
        if isinstance(host.engine, EngineClient):
            await host.engine.aclose()
        else:
            host.engine.close()


def _post(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


async def _until(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.005)


def _read_stream(base: str, body: dict) -> list[str]:
    req = urllib.request.Request(base + "/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [line.decode().removeprefix("data: ").strip() for line in r if line.startswith(b"data: ")]


async def _ask(port: int, prompt: str) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(prompt.encode() + b"\n")
    await writer.drain()
    answer = json.loads(await reader.readline())
    writer.close()
    return answer


async def test_a_third_party_frontend_mounts_beside_the_built_in_ones(host_factory):
    host, fronts = await host_factory({"enabled": ["line", "openai"], "line": {"max_tokens": 5},
                                       "openai": {"port": 0}})
    assert [f.name for f in host.frontends] == ["line", "openai"]
    assert all(isinstance(f, Frontend) for f in host.frontends)
    assert "line" in host.banner() and "tcp://127.0.0.1:" in host.banner()
    port = int(fronts["line"].urls()[0].rsplit(":", 1)[1])
    answer = await _ask(port, "hello")
    assert answer["finish_reason"] == "length" and answer["text"]


async def test_the_queue_limit_counts_requests_of_every_frontend(host_factory):
    host, fronts = await host_factory({"enabled": ["line", "openai"], "line": {"max_tokens": 900},
                                       "openai": {"port": 0}}, slow=True, max_queue=1)
    port = int(fronts["line"].urls()[0].rsplit(":", 1)[1])
    long = asyncio.ensure_future(_ask(port, "a long one"))
    await _until(lambda: host.engine.num_unfinished == 1)
    base = fronts["openai"].urls()[0]
    loop = asyncio.get_running_loop()
    status, headers, body = await loop.run_in_executor(None, _post, base + "/chat/completions", {
        "model": host.engine.config.engine.model, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and body["error"]["code"] == "overloaded" and int(headers["retry-after"]) >= 1
    assert not long.done()
    host.engine.abort(next(iter(fronts["line"].running)))
    assert (await long)["finish_reason"] == "aborted"
    await wait_idle(host.engine)


async def test_openai_rate_limit_is_429_with_retry_after(host_factory):
    host, fronts = await host_factory({"enabled": ["openai"], "openai": {"port": 0}},
                                      rate_limits=RateLimits(requests_per_minute=1))
    base, model = fronts["openai"].urls()[0], host.engine.config.engine.model
    loop = asyncio.get_running_loop()
    ask = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await loop.run_in_executor(None, _post, base + "/chat/completions", ask))[0] == 200
    status, headers, body = await loop.run_in_executor(None, _post, base + "/chat/completions", ask)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(headers["retry-after"]) <= 60


async def test_one_shutdown_ends_every_frontends_requests(host_factory):
    host, fronts = await host_factory({"enabled": ["line", "openai"], "line": {"max_tokens": 900},
                                       "openai": {"port": 0}}, slow=True)
    port = int(fronts["line"].urls()[0].rsplit(":", 1)[1])
    long = asyncio.ensure_future(_ask(port, "a long one"))
    body = {"model": host.engine.config.engine.model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 900, "ignore_eos": True, "stream": True}
    sse = asyncio.get_running_loop().run_in_executor(None, _read_stream, fronts["openai"].urls()[0], body)
    await _until(lambda: host.engine.num_unfinished == 2)
    await host.shutdown(0)
    assert (await long)["finish_reason"] == "aborted"
    events = await sse  # the stream ends properly: its finish chunk, then [DONE]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert host.gateway.draining and host.engine.num_unfinished == 0
    assert host.engine.cache.num_used_blocks == 0


async def test_without_an_origin_list_browsers_must_come_from_the_server_itself(host_factory):
    host, fronts = await host_factory({"enabled": ["openai"], "openai": {"port": 0}})
    base = fronts["openai"].urls()[0]
    loop = asyncio.get_running_loop()

    def get(origin: str, host: str | None = None) -> int:
        req = urllib.request.Request(base + "/models", headers={"Origin": origin, **({"Host": host} if host else {})})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert await loop.run_in_executor(None, get, "https://evil.example") == 403
    assert await loop.run_in_executor(None, get, base.removesuffix("/v1")) == 200
    # DNS rebinding: the attacker's name resolves to 127.0.0.1, so the page's Origin and the
    # Host header agree, but neither is a loopback name
    port = base.rsplit(":", 1)[1].split("/")[0]
    assert await loop.run_in_executor(None, get, f"http://evil.example:{port}", f"evil.example:{port}") == 403


async def test_a_shutdown_during_admission_submits_nothing_and_every_client_hears(host_factory, monkeypatch):
    """Requests still being tokenised when the drain begins are refused, not submitted after it."""
    from tokenloom.protocols.websocket.client import Client, RequestError

    host, fronts = await host_factory({"enabled": ["websocket", "openai"], "websocket": {"port": 0},
                                       "openai": {"port": 0}})
    engine = host.engine
    slow_tokenise = engine.prompt_ids_async

    async def prompt_ids_async(*args, **kwargs):
        await asyncio.sleep(0.5)
        return await slow_tokenise(*args, **kwargs)

    monkeypatch.setattr(engine, "prompt_ids_async", prompt_ids_async)
    body = {"model": engine.config.engine.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    http = asyncio.get_running_loop().run_in_executor(None, _post, fronts["openai"].urls()[0] + "/chat/completions",
                                                      body)
    async with Client(fronts["websocket"].urls()[0]) as ws:
        ws_request = asyncio.ensure_future(_drain(ws.generate("hi", params={"max_tokens": 4})))
        await _until(lambda: host.gateway.num_admitting == 2)
        await host.shutdown(0)
        with pytest.raises(RequestError) as info:
            await ws_request
        assert info.value.code == "shutting_down"
    status, _, answer = await http
    assert status == 503 and answer["error"]["code"] == "shutting_down"
    assert host.gateway.num_admitting == 0 and engine.num_unfinished == 0
    assert (await engine_stats(engine))["kv_blocks_used"] == 0


async def _drain(events):
    return [ev async for ev in events]
