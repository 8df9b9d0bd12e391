"""What a failure or a bad request tells the client and the log (issue "Hardening, second
round", items 3 and 4 and the 'also seen'): an engine failure under a whole OpenAI answer
is a 503 carrying the failure, its log record carries the exception's type, message and
stack; out-of-range ``top_logprobs`` is named as such; a client's value is echoed back
bounded; a WebSocket frame too deep to decode still names its request."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from tokenloom.core.build import config_from_sources
from tokenloom.core.engine import AsyncEngine
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.logging import configure_logging
from tokenloom.core.plugins import PluginManager
from tokenloom.plugins.decoders.standard import StandardDecoder
from tokenloom.protocols.gateway import FrontendHost, ServerOptions
from tokenloom.protocols.websocket.client import Client, RequestError
from tokenloom.protocols.websocket.messages import decode_client

from conftest import collect, tiny_engine_kwargs, wait_idle

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

HI = [{"role": "user", "content": "hi"}]


class FaultInjector:
    """The standard decoder, except that the next ``armed`` steps raise."""

    def __init__(self):
        self.armed = 0

    @hookimpl
    def register_decoders(self, register):
        injector = self

        class FaultyDecoder(StandardDecoder):
            def step(self, batch):
                if injector.armed > 0:
                    injector.armed -= 1
                    raise RuntimeError("injected fault")
                return super().step(batch)

        register("faulty", FaultyDecoder, description="standard, with injected step failures (tests)")


@pytest.fixture
async def served(tiny_model_dir):
    """Both frontends in this process over a tiny engine whose steps can be made to fail:
    (host, faults, OpenAI base URL, WebSocket URL, model name)."""
    faults = FaultInjector()
    pm = PluginManager(load_entry_points=False, extra=[faults])
    kwargs = tiny_engine_kwargs(tiny_model_dir, decoder="faulty", max_restarts=100, restart_backoff_s=0.2,
                                frontends={"enabled": ["openai", "websocket"], "openai": {"port": 0},
                                           "websocket": {"port": 0}})
    engine = AsyncEngine(config_from_sources(pm, None, None, kwargs), plugin_manager=pm)
    host = FrontendHost(engine, ServerOptions())
    await host.start()
    fronts = {f.name: f for f in host.frontends}
    yield host, faults, fronts["openai"].urls()[0], fronts["websocket"].urls()[0], engine.config.engine.model
    await host.shutdown(0)
    await engine.shutdown()
    engine.close()


def _request(url: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


async def _call(*args, **kw):
    return await asyncio.get_running_loop().run_in_executor(None, lambda: _request(*args, **kw))


async def _until_healthy(engine, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if engine.health_report().status == "ok":
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the engine did not restart")


async def test_an_engine_failure_is_a_503_with_the_failure_and_a_logged_stack(served, capsys):
    host, faults, base, _, model = served
    try:
        configure_logging("INFO", "json")
        capsys.readouterr()
        faults.armed = 1
        status, headers, body = await _call(base + "/chat/completions", {"model": model, "messages": HI,
                                                                        "max_tokens": 4})
        assert status == 503, body  # was 500, which the README promises never happens
        error = json.loads(body)["error"]
        assert error["type"] == "server_error" and error["code"] == "engine_error"
        assert "RuntimeError" in error["message"]
        assert int(headers["retry-after"]) >= 1  # the engine is restarting

        records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
        failed = [r for r in records if r["event"] == "engine_step_failed"]
        assert len(failed) == 1 and "exc_info" not in failed[0]
        (exc,) = failed[0]["exception"]
        assert exc["exc_type"] == "RuntimeError" and exc["exc_value"] == "injected fault"
        assert any(f["name"] == "step" and f["filename"].endswith("test_error_reporting.py") for f in exc["frames"])
        assert all("locals" not in f for f in exc["frames"])  # locals may hold prompts or keys

        await _until_healthy(host.engine)
        configure_logging("INFO", "console")
        faults.armed = 1
        status, _, _ = await _call(base + "/completions", {"model": model, "prompt": "x", "max_tokens": 2})
        assert status == 503
        err = capsys.readouterr().err
        assert "engine_step_failed" in err and "Traceback (most recent call last)" in err
        assert "RuntimeError: injected fault" in err
        await _until_healthy(host.engine)
        status, _, body = await _call(base + "/completions", {"model": model, "prompt": "x", "max_tokens": 2})
        assert status == 200, body
    finally:
        configure_logging("WARNING", "console")
    assert await wait_idle(host.engine)


@pytest.mark.parametrize("top_logprobs, status", [(1000, 400), (-1, 400), (21, 400), (20, 200), (0, 200)])
async def test_top_logprobs_is_bounded_as_openai_bounds_it_and_named(served, top_logprobs, status):
    _, _, base, _, model = served
    got, _, body = await _call(base + "/chat/completions", {"model": model, "messages": HI, "max_tokens": 2,
                                                           "logprobs": True, "top_logprobs": top_logprobs})
    assert got == status, body
    if status == 400:
        error = json.loads(body)["error"]
        assert error["param"] == "top_logprobs" and "top_logprobs must be in [0, 20]" in error["message"], error
    else:
        content = json.loads(body)["choices"][0]["logprobs"]["content"]
        assert all(len(t["top_logprobs"]) == top_logprobs for t in content)


async def test_a_clients_value_is_echoed_back_bounded(served):
    _, _, base, _, model = served
    huge_stop = "s" * 100_000
    status, _, body = await _call(base + "/chat/completions", {"model": model, "messages": HI, "stop": [huge_stop]})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "stop"
    assert len(body) < 1000 and "(100000 characters)" in error["message"], error

    status, _, body = await _call(base + "/chat/completions", {"model": "m" * (1 << 19), "messages": HI})
    assert status == 404 and len(body) < 1000 and f"({1 << 19} characters)" in json.loads(body)["error"]["message"]
    status, _, body = await _call(base + "/models/" + "n" * 8000)
    assert status == 404 and len(body) < 1000
    status, _, body = await _call(base + "/" + "p" * 8000)
    assert status == 404 and len(body) < 1000
    status, _, body = await _call(base + "/models", headers={"Origin": "http://" + "o" * 8000})
    assert status == 403 and len(body) < 1000
    status, _, body = await _call(base + "/chat/completions", {"model": model, "messages": [
        {"role": "user", "content": [{"type": "x" * 100_000}]}]})
    assert status == 400 and len(body) < 1000


async def test_a_websocket_error_echoes_a_value_bounded(served):
    _, _, _, ws_url, _ = served
    async with Client(ws_url) as client:
        with pytest.raises(RequestError) as info:
            await collect(client, "hi", params={"stop": ["s" * 100_000]})
    assert info.value.param == "stop" and len(str(info.value)) < 500 and "(100000 characters)" in str(info.value)


@pytest.mark.parametrize("frame", [
    '{"type": "generate", "id": "deep", "prompt": "x", "params": ' + "[" * 1000 + "]" * 1000 + "}",
    '{"type": "generate", "id": "deep", "x": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"type": "generate", "id": "deep", "params": ' + '{"a": ' * 3000 + "1" + "}" * 3000 + "}",
    '{"type": "generate", "id": "deep", "prompt": ' + "[" * 100_000,  # nested past recursion, and cut short
    '{"id": "deep", "type": "generate", "prompt": "unterminated',
])
def test_a_frame_too_deep_or_broken_to_decode_still_names_its_request(frame):
    err = decode_client(frame)
    assert err.code in ("invalid_message", "invalid_json") and err.id == "deep", err


@pytest.mark.parametrize("frame", [
    '{"type": "generate", "x": {"id": "nested"}, "y": ' + "[" * 5000,  # not the top level's id
    '[{"id": "in an array"}, ' + "[" * 5000,
    '{"type": "generate", "id": 5, "x": ' + "[" * 5000,  # not a string
    '{"type": "generate", "id": "' + "i" * 200 + '", "x": ' + "[" * 5000,  # longer than an id may be
])
def test_the_shallow_scan_names_only_a_top_level_string_id(frame):
    assert decode_client(frame).id is None


async def test_a_deep_frame_error_reaches_its_request_over_the_wire(served):
    _, _, _, ws_url, _ = served
    async with Client(ws_url) as client:
        await client.send_raw('{"type": "generate", "id": "deep", "prompt": "x", "params": '
                              + "[" * 1000 + "]" * 1000 + "}")
        err = await asyncio.wait_for(client.errors.get(), 5)
        assert err.id == "deep" and err.param == "params"
        assert (await client.ping("alive")).data == "alive"
