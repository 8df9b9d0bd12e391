"""`engine.overlap`: a step's outputs are published while the next step runs. Only the
timing of the streams may change: tokens, text, logprobs, finish reasons and the blocks
coming back must be the same with it on and off."""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.outputs import Finished, TokenDelta
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.plugins.decoders.base import SharedStepDecoder

from conftest import tiny_engine_kwargs

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _requests(stop_text: str = "e", stop_id: int = 41):
    """A mix that exercises every way to stop: greedy and seeded sampling, stop strings
    (detokenised before the next step), stop token ids, lengths, logprobs, n-gram drafts."""
    prompts = [[30 + (7 * i + j) % 90 for j in range(5 + 3 * i)] for i in range(10)]
    params = []
    for i in range(10):
        kw = dict(max_tokens=6 + 5 * i, ignore_eos=i % 3 != 0)
        if i % 2:
            kw.update(temperature=0.9, top_p=0.9, seed=100 + i)
        else:
            kw.update(temperature=0)
        if i in (2, 7):
            kw["logprobs"] = 2
        if i == 4:
            kw["stop"] = [stop_text]
        if i == 5:
            kw["stop_token_ids"] = [stop_id]
        if i == 6:
            kw["decoder"] = "ngram"
        params.append(SamplingParams(**kw))
    return prompts, params


async def _run_all(engine, prompts, params):
    """Each request's (ids, text, finish reason, streamed logprobs), run together."""
    results = await asyncio.gather(*(_collect(engine, p, q, f"q{i}") for i, (p, q) in
                                     enumerate(zip(prompts, params, strict=True))))
    return [(final.token_ids, final.text, final.finish_reason,
             [(lp.token_id, round(lp.logprob, 5)) for d in deltas for lp in (d.logprobs or [])])
            for deltas, final in results]


@pytest.mark.parametrize("num_kv_blocks", [256, 24])  # 24 blocks of 4: preemption
async def test_outputs_identical_with_overlap_on_and_off(tiny_model_dir, num_kv_blocks):
    from tokenloom.core.engine import AsyncEngine

    prompts, params = _requests()
    probe = AsyncEngine.from_options(**tiny_engine_kwargs(tiny_model_dir))  # stops that will hit, from plain runs
    try:
        plain = await _run_all(probe, prompts[4:5] + prompts[5:6] * 8, [
            msgspec.structs.replace(params[4], stop=[])] + [
            msgspec.structs.replace(params[5], stop_token_ids=[], max_tokens=j) for j in range(1, 9)])
    finally:
        await probe.shutdown()
        probe.close()
    text = plain[0][1]
    ids, texts = plain[-1][0], [r[1] for r in plain[1:]]  # texts[j - 1]: the first j tokens'
    # a stop token that adds text of its own, at its first occurrence
    j = next(j for j in range(3, 8) if texts[j] != texts[j - 1] and ids[j] not in ids[:j])
    prompts, params = _requests(stop_text=text[len(text) // 2:][:2], stop_id=ids[j])
    text_before_stop_id = texts[j - 1]
    got = {}
    for overlap in (False, True):
        # max_num_seqs set: auto would fit it to the small pool and avoid the preemption tested here
        engine = AsyncEngine.from_options(**tiny_engine_kwargs(tiny_model_dir, overlap=overlap,
                                                               num_kv_blocks=num_kv_blocks, block_size=4,
                                                               scheduler={"max_num_seqs": 64}))
        try:
            got[overlap] = await _run_all(engine, prompts, params)
            assert engine.cache.stats().num_used_blocks == 0
            if num_kv_blocks == 24:
                assert engine.stats()["preemptions"] > 0
        finally:
            await engine.shutdown()
            engine.close()
    assert got[True] == got[False]
    assert got[True][4][2] == got[True][5][2] == "stop"  # the stops did stop something
    assert got[True][5][1] == text_before_stop_id  # a stop token's own text is not part of the text
    assert sum(len(lps) for *_, lps in got[True]) > 10


async def _collect(engine, prompt, params, request_id):
    deltas, final = [], None
    async for item in engine.generate(prompt, params, request_id=request_id):
        if isinstance(item, TokenDelta):
            deltas.append(item)
        else:
            final = item
    return deltas, final


@pytest.mark.parametrize("overlap", [False, True])
async def test_every_stream_is_whole_and_ends_once(tiny_model_dir, overlap):
    """Streamed deltas add up to the final text and ids; an abort mid-stream still ends its
    stream with one Finished; a request past its deadline too."""
    from tokenloom.core.engine import AsyncEngine

    engine = AsyncEngine.from_options(**tiny_engine_kwargs(tiny_model_dir, overlap=overlap))
    try:
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        tasks = [asyncio.create_task(_collect(engine, [40 + i, 41, 42], SamplingParams(
            temperature=0, max_tokens=20 + i, ignore_eos=True, stop=["xq"] if i % 2 else []), f"r{i}"))
            for i in range(6)]
        aborted = asyncio.create_task(_collect(engine, [50, 51], long, "abort-me"))
        timed = asyncio.create_task(_collect(engine, [60, 61], SamplingParams(
            temperature=0, max_tokens=400, ignore_eos=True, timeout_s=0.05), "late"))
        while engine.counters.steps < 5:
            await asyncio.sleep(0.001)
        assert engine.abort("abort-me")
        for deltas, final in await asyncio.gather(*tasks, aborted, timed):
            assert isinstance(final, Finished)
            assert [t for d in deltas for t in d.token_ids] == final.token_ids
            assert "".join(d.text for d in deltas) == final.text
        assert (await aborted)[1].finish_reason == "aborted"
        assert (await timed)[1].finish_reason in ("timeout", "length")
        assert engine.num_unfinished == 0 and engine.cache.stats().num_used_blocks == 0
    finally:
        await engine.shutdown()
        engine.close()


class StepClock:
    """A decoder plugin whose steps take 20 ms more and record when they ran, and a hook
    that records when each request's end was published (5 ms into publishing it)."""

    def __init__(self):
        self.steps: list[tuple[float, float]] = []
        self.finished: list[float] = []
        self.lock = threading.Lock()

    @hookimpl
    def register_decoders(self, register):
        clock = self

        class Timed(SharedStepDecoder):
            name = "timed"

            def step(self, batch):
                t0 = time.perf_counter()
                time.sleep(0.02)
                out = super().step(batch)
                with clock.lock:
                    clock.steps.append((t0, time.perf_counter()))
                return out

        register("timed", Timed, description="a standard step 20 ms slower (tests)")

    @hookimpl
    def request_finished(self, request_id, output):
        time.sleep(0.005)  # publishing takes a while: past the next step's start when they overlap
        self.finished.append(time.perf_counter())


@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_are_published_while_the_next_step_runs(tiny_model_dir, overlap):
    """With overlap on, requests that end while others go on are published during the next
    step; with it off, always between two steps."""
    from tokenloom import LLM
    from tokenloom.core.plugins import PluginManager

    clock = StepClock()
    pm = PluginManager(load_entry_points=False, extra=[clock])
    with LLM(plugin_manager=pm, **tiny_engine_kwargs(tiny_model_dir, decoder="timed", overlap=overlap)) as llm:
        llm.generate([[40 + i, 41] for i in range(6)],
                     [SamplingParams(temperature=0, max_tokens=3 + 3 * i, ignore_eos=True) for i in range(6)])
    inside = sum(any(a < t < b for a, b in clock.steps) for t in clock.finished)
    if overlap:
        assert inside >= 3  # five of six end while another still runs
    else:
        assert inside == 0
