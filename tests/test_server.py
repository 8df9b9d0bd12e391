"""The WebSocket server, tested with a real server on a loopback port and real clients."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tokenloom.protocols.websocket.client import Client, RequestError
from tokenloom.protocols.websocket.messages import Delta, Done, decode_server, encode

from conftest import SlowSteps, engine_stats
from conftest import collect as _collect
from conftest import wait_idle as _wait_idle

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}


async def test_session_and_streaming_match_the_engine(make_server):
    server, url = await make_server()
    async with Client(url) as client:
        assert client.session.protocol == 1 and client.session.limits.max_model_len == 1024
        assert client.session.strategies["scheduler"]["name"] == "continuous"
        text, done, events = await _collect(client, "hello", params={"temperature": 0, "max_tokens": 20,
                                                                     "ignore_eos": True})
    assert isinstance(done, Done) and done.finish_reason == "length" and done.usage.completion_tokens == 20
    assert sum(len(e.token_ids) for e in events if isinstance(e, Delta)) == 20
    direct = [i async for i in server.engine.generate("hello", __import__("tokenloom").SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True))][-1]
    assert text == direct.text and done.metrics.ttft_ms > 0


async def test_eight_requests_multiplexed_on_one_connection(make_server):
    server, url = await make_server()
    async with Client(url) as client:
        prompts = [f"prompt number {i}" for i in range(8)]
        results = await asyncio.gather(*(_collect(client, p, params={"temperature": 0, "max_tokens": 12 + i,
                                                                      "ignore_eos": True})
                                         for i, p in enumerate(prompts)))
    assert [r[1].usage.completion_tokens for r in results] == [12 + i for i in range(8)]
    assert (await engine_stats(server.engine))["peak_running"] > 1


async def test_done_reports_cached_prompt_tokens(make_server):
    server, url = await make_server(engine={"cache_manager": "radix"})
    async with Client(url) as client:
        prompt = "a long shared system prompt, the same every time: " * 3
        _, first, _ = await _collect(client, prompt + "one", params={"max_tokens": 2, "ignore_eos": True})
        _, second, _ = await _collect(client, prompt + "two", params={"max_tokens": 2, "ignore_eos": True})
        _, salted, _ = await _collect(client, prompt + "two", params={"max_tokens": 2, "ignore_eos": True},
                                      cache_salt="other-tenant")
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens >= len(prompt.encode()) - 1
    assert salted.usage.cached_tokens == 0


async def test_cancel_and_unknown_cancel(make_server):
    server, url = await make_server()
    async with Client(url) as client:
        got = []
        async for ev in client.generate("x", params=LONG, id="c1"):
            got.append(ev)
            if len(got) == 3:
                await client.cancel("c1")
        assert got[-1].finish_reason == "cancelled"
        await client.cancel("nope")
        err = await asyncio.wait_for(client.errors.get(), 5)
        assert err.code == "unknown_id" and err.id == "nope"
        _, done, _ = await _collect(client, "still works", params={"max_tokens": 3, "ignore_eos": True})
        assert done.finish_reason == "length"
    assert await _wait_idle(server.engine)


async def test_disconnect_returns_blocks_within_one_step(make_server, monkeypatch):
    from tokenloom.protocols.websocket.connection import Connection

    server, url = await make_server()
    engine = server.engine
    client = await Client(url).__aenter__()
    streams = [client.generate(f"p{i}", params=LONG) for i in range(3)]
    for s in streams:
        await s.__anext__()
    assert (await engine_stats(engine))["kv_blocks_used"] > 0
    # count from the moment the server sees the disconnect: the tiny model steps in well under
    # a millisecond, so how many steps the close frame takes to arrive depends on the machine's
    # load, not on the server (with the core in its own process, stats() is the last reading)
    seen: list[int] = []
    abort_all = Connection.abort_all

    def recording_abort_all(conn):
        seen.append(engine.stats()["steps"])
        abort_all(conn)

    monkeypatch.setattr(Connection, "abort_all", recording_abort_all)
    await client._ws.close()
    assert await _wait_idle(engine)
    assert seen, "the disconnect did not abort the connection's requests"
    assert (await engine_stats(engine))["steps"] - seen[0] <= 2  # the step in flight, then the aborts


async def test_never_reading_client_is_cut_and_memory_bounded(make_server):
    server, url = await make_server(send_timeout_s=0.5, write_limit_bytes=512, socket_send_buffer=4096)
    engine = server.engine
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    # close_timeout: the server drops this connection; the client's own close at the end would
    # wait its default 10 s for a closing handshake that cannot come
    ws = await connect(url, sock=sock, max_queue=1, close_timeout=0.5)
    await ws.recv()  # session
    params = {"temperature": 1.0, "max_tokens": 900, "ignore_eos": True, "logprobs": 20}
    for i in range(4):
        await ws.send(json.dumps({"type": "generate", "id": f"g{i}", "prompt": "spam", "params": params}))
    # stop reading: the server must give up on this connection within send_timeout
    conn = next(iter(server.connections))
    peak_pending = 0
    for _ in range(1000):
        if not server.connections:
            break
        peak_pending = max(peak_pending, len(conn.out))
        await asyncio.sleep(0.01)
    assert not server.connections, "the server kept a connection whose client never reads"
    assert peak_pending <= 4 + 4  # one pending delta per request plus control messages
    assert conn.out.coalesced > 0
    assert await _wait_idle(engine)
    await ws.close()


BAD_FRAMES = [
    ("{not json", "invalid_json", None),
    ('{"type": "teleport"}', "unknown_type", "type"),
    ('{"type": "generate", "id": "a", "prompt": "x", "colour": 1}', "invalid_message", "colour"),
    ('{"type": "generate", "id": "a", "prompt": "x", "params": {"temperature": NaN}}', "invalid_json", None),
    ('{"type": "generate", "id": "a", "prompt": "x", "params": {"temperature": Infinity}}', "invalid_json", None),
    ('{"type": "generate", "id": "a", "prompt": "x", "params": {"max_tokens": 10000000000000000000000000000000000000000}}',
     "context_length_exceeded", "max_tokens"),
    ('{"type": "generate", "id": "a", "prompt": "x", "params": {"max_tokens": true}}', "invalid_message", "max_tokens"),
    ('{"type": "generate", "id": "a", "prompt": "x", "params": {"top_k": 1.5}}', "invalid_message", "top_k"),
    ('{"type": "generate", "id": "a", "prompt": "x", "params": {"temperature": -1}}', "invalid_request", "temperature"),
    ('{"type": "generate", "id": "a", "prompt": "x", "params": {"top_p": 0}}', "invalid_request", "top_p"),
    ('{"type": "generate", "id": "a", "prompt": ""}', "invalid_request", "prompt"),
    ('{"type": "generate", "id": "a"}', "invalid_request", "prompt"),
    ('{"type": "generate", "id": "a", "prompt": "' + "x" * 2000 + '"}', "context_length_exceeded", "prompt"),
    ('{"type": "generate", "id": "a", "prompt": "' + "x" * 1000 + '", "params": {"max_tokens": 100}}',
     "context_length_exceeded", "max_tokens"),
    ("[" * 1000 + "]" * 1000, "invalid_message", None),  # msgspec recurses per level: once a 1011
    ('{"type": "ping", "data": ' + "[" * 2000 + "]" * 2000 + "}", "invalid_message", "data"),
    ('{"type": "generate", "id": "a", "prompt_token_ids": [1, 99999]}', "invalid_request", "prompt"),
    ('{"type": "generate", "id": "", "prompt": "x"}', "invalid_message", "id"),
    ('{"type": "cancel"}', "invalid_message", "id"),
    ("[1, 2, 3]", "invalid_message", None),
]


async def test_every_bad_input_gets_a_coded_error_and_the_connection_survives(make_server):
    server, url = await make_server(max_frame_bytes=4096)
    async with Client(url) as client:
        for frame, code, param in BAD_FRAMES:
            await client.send_raw(frame)
            err = await asyncio.wait_for(client.errors.get(), 5)
            assert (err.code, err.param) == (code, param), frame[:80]
            assert "Traceback" not in err.message and "/" not in err.message.replace("1/", ""), err.message
        await client.send_raw(b"\x00binary")
        assert (await asyncio.wait_for(client.errors.get(), 5)).code == "binary_not_supported"
        assert (await client.ping("still here")).data == "still here"
    # an oversized frame closes with 1009, invalid UTF-8 with 1007
    for payload, code in ((("x" * 5000), 1009), (b'{"type": "ping", "data": "\xff\xfe"}', 1007)):
        async with connect(url) as ws:
            await ws.recv()
            await ws.send(payload, text=True)
            with pytest.raises(ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 5)
            assert ws.close_code == code


async def test_api_key(make_server, monkeypatch):
    server, url = await make_server(api_key="s3cret")
    with pytest.raises(InvalidStatus) as info:
        async with Client(url):
            pass
    assert info.value.response.status_code == 401
    with pytest.raises(InvalidStatus):
        async with Client(url, api_key="wrong"):
            pass
    async with Client(url, api_key="s3cret") as client:
        _, done, _ = await _collect(client, "hi", params={"max_tokens": 2, "ignore_eos": True})
        assert done.finish_reason == "length"


async def test_origin_allowlist(make_server):
    server, url = await make_server(allowed_origins=["https://good.example"])
    with pytest.raises(InvalidStatus) as info:
        async with Client(url, origin="https://evil.example"):
            pass
    assert info.value.response.status_code == 403
    async with Client(url, origin="https://good.example"):
        pass


async def test_without_a_list_only_the_servers_own_pages_may_connect(make_server):
    server, url = await make_server()
    for origin in ("https://evil.example", "null", f"http://127.0.0.1:{server.port + 1}"):
        with pytest.raises(InvalidStatus) as info:
            async with Client(url, origin=origin):
                pass
        assert info.value.response.status_code == 403, origin
    async with Client(url, origin=f"http://127.0.0.1:{server.port}"):  # the playground's own socket
        pass
    async with Client(url):  # no Origin: not a browser
        pass


async def test_overload_refuses_new_work_only(make_server):
    server, url = await make_server(max_queue=2)
    async with Client(url) as client:
        # long enough to be running still when the third arrives, wherever the engine core runs
        running = [client.generate(f"r{i}", params={"temperature": 0, "max_tokens": 900, "ignore_eos": True})
                   for i in range(2)]
        firsts = [await s.__anext__() for s in running]
        with pytest.raises(RequestError) as info:
            await _collect(client, "third", params={"max_tokens": 5})
        assert info.value.code == "overloaded" and info.value.retry_after_ms > 0
        rest = []
        for s in running:
            rest.append([ev async for ev in s])
        assert all(r[-1].finish_reason == "length" for r in rest)
        assert all(isinstance(f, Delta) for f in firsts)


async def test_health_and_metrics_over_http(make_server):
    server, url = await make_server()
    async with Client(url) as client:
        await _collect(client, "hi", params={"max_tokens": 3, "ignore_eos": True})
    base = url.replace("ws://", "http://")
    loop = asyncio.get_running_loop()
    health = json.loads(await loop.run_in_executor(None, lambda: urllib.request.urlopen(base + "/health").read()))
    assert health["status"] == "ok" and health["kv_blocks_total"] == 256
    metrics = (await loop.run_in_executor(None, lambda: urllib.request.urlopen(base + "/metrics").read())).decode()
    assert 'tokenloom_requests_total{finish_reason="length"} 1.0' in metrics
    assert "tokenloom_kv_cache_usage_ratio" in metrics
    with pytest.raises(urllib.error.HTTPError) as info:
        await loop.run_in_executor(None, lambda: urllib.request.urlopen(base + "/nope"))
    assert info.value.code == 404
    # closed now: held open (by the traceback's reference cycle) it kept the server's shutdown
    # waiting for the client to hang up, 10 s (websockets' close timeout), at fixture teardown
    info.value.close()


async def test_graceful_shutdown(make_server):
    server, url = await make_server(plugins=[SlowSteps()])
    async with Client(url) as client:
        long = client.generate("long", params={"temperature": 0, "max_tokens": 900, "ignore_eos": True})
        short = client.generate("short", params={"max_tokens": 5, "ignore_eos": True})
        await long.__anext__()
        await short.__anext__()  # both run: the short one needs ~4 steps more, the long one ~900
        await server.shutdown(deadline_s=1.0)
        short_events = [ev async for ev in short]
        assert short_events[-1].finish_reason == "length"
        long_events = [ev async for ev in long]
        assert long_events[-1].finish_reason == "aborted"
        await asyncio.sleep(0.05)
        assert client._ws.close_code == 1001
    assert server.engine.num_unfinished == 0


async def test_hundred_cancelled_ten_complete(make_server):
    server, url = await make_server(engine={"num_kv_blocks": 1024, "scheduler": {"name": "continuous",
                                                                                   "max_num_seqs": 128}})
    async with Client(url) as client:
        async def cancelled(i):
            n = 0
            last = None
            async for ev in client.generate(f"c{i}", params=LONG, id=f"cancel-{i}"):
                last = ev
                if isinstance(ev, Delta):
                    n += len(ev.token_ids)
                    if n >= 5 and n - len(ev.token_ids) < 5:
                        await client.cancel(f"cancel-{i}")
            return last

        async def complete(i):
            return await _collect(client, f"k{i}", params={"temperature": 0, "max_tokens": 30, "ignore_eos": True})

        results = await asyncio.gather(*(cancelled(i) for i in range(100)), *(complete(i) for i in range(10)))
    assert all(r.finish_reason == "cancelled" for r in results[:100])
    assert all(r[1].finish_reason == "length" and r[1].usage.completion_tokens == 30 for r in results[100:])
    assert await _wait_idle(server.engine)
    stats = await engine_stats(server.engine)
    assert stats["running"] == stats["waiting"] == 0


def test_encode_roundtrip():
    d = decode_server(encode(__import__("tokenloom.protocols.websocket.messages", fromlist=["Pong"]).Pong(data="x")))
    assert d.data == "x"
