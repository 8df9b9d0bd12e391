"""The engine core in its own process (core/engine_process.py): the same tokens as in-process,
per-step batches back, and the failure policy when the core process dies."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tokenloom.core.build import config_from_sources
from tokenloom.core.engine import AsyncEngine
from tokenloom.core.engine_process import EngineClient
from tokenloom.core.errors import ClientError, ConfigError, EngineUnavailable, RequestTooLong
from tokenloom.core.outputs import Finished, TokenDelta, read_stream
from tokenloom.core.plugins import PluginManager
from tokenloom.core.sampling_params import SamplingParams

from conftest import engine_core_pid, engine_stats, start_serve_process, tiny_engine_kwargs

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _config(model_dir, **kw):
    return config_from_sources(PluginManager(), None, None, tiny_engine_kwargs(model_dir, **kw))


async def _run(engine, prompts, params):
    async def one(i, p):
        ids = await engine.prompt_ids_async(p)
        req = await engine.submit_async(ids, params[i], request_id=f"r{i}")
        items = [item async for item in engine.stream(req)]
        return items

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


async def test_separate_core_gives_the_inline_engines_outputs(tiny_model_dir):
    prompts = [f"prompt {i} " * (1 + i % 4) for i in range(6)]
    params = [SamplingParams(max_tokens=10 + 3 * i, logprobs=2 if i % 2 else None, stop=["zz"] if i == 3 else [],
                             **GREEDY) for i in range(6)]
    inline = AsyncEngine(_config(tiny_model_dir))
    try:
        expected = await _run(inline, prompts, params)
    finally:
        await inline.shutdown()
        inline.close()
    client = await EngineClient.start(_config(tiny_model_dir), log_level="WARNING")
    try:
        got = await _run(client, prompts, params)
        for want, have in zip(expected, got, strict=True):
            assert isinstance(have[-1], Finished) and sum(isinstance(x, Finished) for x in have) == 1
            w, h = want[-1], have[-1]
            assert (h.token_ids, h.text, h.finish_reason, h.usage) == (w.token_ids, w.text, w.finish_reason, w.usage)
            deltas = [x for x in have if isinstance(x, TokenDelta)]
            assert "".join(d.text for d in deltas) == h.text
            assert [t for d in deltas for t in d.token_ids] == h.token_ids
            wl = [lp for x in want if isinstance(x, TokenDelta) for lp in (x.logprobs or [])]
            hl = [lp for x in have if isinstance(x, TokenDelta) for lp in (x.logprobs or [])]
            # (the batches differ with arrival timing: fp32 sums may differ in the last bits)
            assert [(lp.token_id, [t.token_id for t in lp.top]) for lp in hl] == \
                   [(lp.token_id, [t.token_id for t in lp.top]) for lp in wl]
            assert [lp.logprob for lp in hl] == pytest.approx([lp.logprob for lp in wl], abs=1e-4)
        stats = await engine_stats(client)
        assert stats["kv_blocks_used"] == 0 and stats["finished_requests"] == 6
        assert stats["engine_rss_bytes"] > 0 and client.core_pid != os.getpid()
    finally:
        await client.shutdown()
        await client.aclose()


async def test_refusals_cross_back_typed(tiny_model_dir):
    client = await EngineClient.start(_config(tiny_model_dir, num_kv_blocks=4), log_level="WARNING")
    try:
        ids = await client.prompt_ids_async("hello")
        with pytest.raises(RequestTooLong) as info:  # never fits 4 blocks of 16: refused by the core's scheduler
            await client.submit_async(ids, SamplingParams(max_tokens=100), request_id="a")
        assert info.value.param == "max_tokens"
        with pytest.raises(RequestTooLong):  # past the context: refused before it is sent
            await client.submit_async(ids, SamplingParams(max_tokens=10**30), request_id="b")
        with pytest.raises(ClientError) as info:
            await client.submit_async(ids, SamplingParams(max_tokens=4, decoder="nope"), request_id="c")
        assert info.value.param == "decoder"
        assert client.num_unfinished == 0
        out = [x async for x in client.generate("hello", SamplingParams(max_tokens=3, **GREEDY))]
        assert out[-1].finish_reason == "length"
    finally:
        await client.aclose()


async def test_start_up_errors_reach_the_caller(tmp_path):
    config = config_from_sources(PluginManager(), None, None, {"model": str(tmp_path / "missing.gguf")})
    with pytest.raises((ConfigError, FileNotFoundError, ValueError)):
        await EngineClient.start(config, log_level="ERROR")


async def _streams_mid_flight(client, n):
    reqs = []
    for i in range(n):
        ids = await client.prompt_ids_async(f"story {i}")
        reqs.append(await client.submit_async(ids, SamplingParams(max_tokens=900, **GREEDY), request_id=f"s{i}"))
    firsts = [await r.queue.get() for r in reqs]
    assert all(isinstance(f, TokenDelta) for f in firsts)
    return reqs


async def _drain(req):
    return [x async for x in read_stream(req.queue)]


async def test_a_killed_core_ends_every_request_at_once_and_is_restarted(tiny_model_dir):
    client = await EngineClient.start(_config(tiny_model_dir, restart_backoff_s=0.1), log_level="ERROR")
    try:
        reqs = await _streams_mid_flight(client, 3)
        old_pid = client.core_pid
        t0 = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        ends = await asyncio.wait_for(asyncio.gather(*(_drain(r) for r in reqs)), 5)
        assert time.monotonic() - t0 < 1.0
        for items in ends:
            finals = [x for x in items if isinstance(x, Finished)]
            assert len(finals) == 1 and finals[0].finish_reason == "error" and "SIGKILL" in finals[0].error
        report = client.health_report()
        assert report.status == "restarting" and report.engine_failures == 1
        with pytest.raises(EngineUnavailable):
            await client.submit_async([1, 2, 3], SamplingParams(max_tokens=2), request_id="during")
        for _ in range(600):  # the new core loads the model
            if client.health_report().status == "ok":
                break
            await asyncio.sleep(0.1)
        assert client.health_report().status == "ok" and client.core_pid != old_pid
        out = [x async for x in client.generate("again", SamplingParams(max_tokens=4, **GREEDY))]
        assert out[-1].finish_reason == "length" and len(out[-1].token_ids) == 4
        assert (await engine_stats(client))["kv_blocks_used"] == 0
        assert client.health_report().engine_failures == 1
    finally:
        await client.aclose()


async def test_past_max_restarts_a_dead_core_makes_the_engine_dead(tiny_model_dir):
    client = await EngineClient.start(_config(tiny_model_dir, max_restarts=0), log_level="ERROR")
    try:
        reqs = await _streams_mid_flight(client, 2)
        os.kill(client.core_pid, signal.SIGKILL)
        ends = await asyncio.wait_for(asyncio.gather(*(_drain(r) for r in reqs)), 5)
        assert all(items[-1].finish_reason == "error" for items in ends)
        await asyncio.wait_for(client.dead_event.wait(), 1)
        assert client.health_report().status == "dead"
        with pytest.raises(EngineUnavailable):
            await client.submit_async([1, 2], SamplingParams(max_tokens=2), request_id="x")
    finally:
        await client.aclose()


def test_serve_runs_the_core_apart_and_exits_1_when_it_dies_past_the_policy(tiny_model_dir):
    proc, url = start_serve_process("--model", str(tiny_model_dir), "--dtype", "float32", "--port", "0",
                                    "--frontends", "websocket", "--num-kv-blocks", "64", "--set", "max_restarts=0")
    try:
        core = engine_core_pid(proc.pid, wait_s=10)
        assert core is not None, "no engine core process"
        import urllib.request

        base = url.replace("ws://", "http://")
        assert b'"ok"' in urllib.request.urlopen(base + "/health").read()
        os.kill(core, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        assert "engine failed" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_deltas_that_pile_up_are_read_as_one():
    q: asyncio.Queue = asyncio.Queue()
    for i in range(3):
        q.put_nowait(TokenDelta(request_id="a", text=f"t{i}", token_ids=[i]))
    q.put_nowait(Finished(request_id="a", finish_reason="stop", text="t0t1t2", token_ids=[0, 1, 2],
                          usage=_usage(), metrics=_metrics()))
    items = [x async for x in read_stream(q)]
    assert [type(x) for x in items] == [TokenDelta, Finished]
    assert items[0].text == "t0t1t2" and items[0].token_ids == [0, 1, 2]


def _usage():
    from tokenloom.core.outputs import Usage

    return Usage(prompt_tokens=1, cached_tokens=0, completion_tokens=3)


def _metrics():
    from tokenloom.core.outputs import RequestMetrics

    return RequestMetrics(ttft_ms=1.0, tpot_ms=1.0, e2e_ms=3.0, queue_ms=0.0)
