"""`logit_bias` and `n` > 1 (with `best_of`): the engine, the speculative kit, the OpenAI
frontend (the official client against an in-process server) and the WebSocket protocol."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import msgspec
import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.core.build import config_from_sources
from tokenloom.core.engine import AsyncEngine
from tokenloom.core.errors import ClientError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.outputs import Finished, TokenDelta
from tokenloom.core.plugins import PluginManager
from tokenloom.protocols.gateway import FrontendHost, ServerOptions
from tokenloom.protocols.openai import schema
from tokenloom.protocols.websocket.client import Client, RequestError
from tokenloom.testing import check_decoder, make_tiny_model

from conftest import SlowSteps, tiny_engine_kwargs

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox jumps"  # 25 byte tokens: a full block of 16 and a partial one of 9
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(**tiny_engine_kwargs(tiny_model_dir)) as made:
        yield made


def _blocks_back(engine) -> None:
    assert engine.num_unfinished == 0
    assert engine.cache.stats().num_used_blocks == 0
    engine.cache.check_integrity()


# ---- logit_bias ----------------------------------------------------------------------------------
def test_logit_bias_is_validated_naming_it(llm):
    for bias in ({260: 1.0}, {-1: 1.0}, {5: 100.5}, {5: float("nan")}, {5: True}):
        with pytest.raises(ClientError) as info:
            llm.generate("hi", msgspec.structs.replace(GREEDY, logit_bias=bias))
        assert info.value.param == "logit_bias", bias
    with pytest.raises(ClientError) as info:
        SamplingParams(logit_bias={t: -100 for t in range(4)}).validate(vocab_size=4)
    assert info.value.param == "logit_bias" and "every token" in str(info.value)
    SamplingParams(logit_bias={259: 100, 0: -100}).validate(vocab_size=260)


def test_minus_100_bans_the_greedy_choice_and_plus_100_forces_a_token(llm):
    plain = llm.generate(PROMPT, GREEDY)[0].token_ids
    banned = set(plain)
    out = llm.generate(PROMPT, msgspec.structs.replace(GREEDY, logit_bias={t: -100 for t in banned}))[0]
    assert len(out.token_ids) == 12 and not banned & set(out.token_ids)
    # a bias shifts, -100 bans whatever the logits' scale: the first banned token stays out at
    # every temperature, and the raw logprobs are still the model's
    hot = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, seed=3, logprobs=1,
                         logit_bias={plain[0]: -100})
    for o in llm.generate([PROMPT] * 6, hot):
        assert plain[0] not in o.token_ids
    forced = llm.generate(PROMPT, msgspec.structs.replace(GREEDY, logit_bias={65: 100}))[0]
    assert forced.token_ids == [65] * 12
    _blocks_back(llm.engine)


def test_logit_bias_comes_before_the_penalties(llm):
    """A bias is applied first: a presence penalty then lowers the forced token, but +100
    still wins over 2.0 of penalty."""
    params = msgspec.structs.replace(GREEDY, logit_bias={65: 100}, presence_penalty=2.0)
    assert llm.generate(PROMPT, params)[0].token_ids == [65] * 12


def test_logit_bias_with_the_ngram_decoder_is_greedy_identical(llm):
    bias = {t: -100 for t in llm.generate(PROMPT, GREEDY)[0].token_ids[:3]}
    std = msgspec.structs.replace(GREEDY, max_tokens=24, logit_bias=bias, decoder="standard")
    ngram = msgspec.structs.replace(std, decoder="ngram")
    prompts = [PROMPT * 3, "abcabcabcabcabc"]
    assert [o.token_ids for o in llm.generate(prompts, ngram)] == [o.token_ids for o in llm.generate(prompts, std)]


def test_the_decoder_kit_holds_ngram_exact_under_a_logit_bias(tmp_path):
    """Verification rows see the same biased logits as plain sampling: the n-gram decoder's
    samples follow the exact biased law (the kit enumerates it with ``target_probs``), and a
    banned token never appears."""
    model = make_tiny_model(tmp_path / "kit")
    report = check_decoder("ngram", model_dir=model, decoder_options={"prompt_lookup_min": 1}, draws=1200,
                           depth=2, sampling=[{"temperature": 1.0, "logit_bias": {3: -100, 5: 2.5, 7: -1.5}}])
    assert report["stats"]["decoder_ngram_drafted"] > 0 and min(report["sampling_0"]) > 1e-5


# ---- n > 1 ----------------------------------------------------------------------------------------
def test_n_samples_fork_the_prefill_and_match_seeded_single_requests(tiny_model_dir):
    """Sample i of a seeded n-request draws exactly what a lone request seeded seed + i draws:
    the forks' KV (shared full blocks, the copied partial block) is the prompt's own. The
    prompt is prefilled once (the forks' first tokens come from the same logits row)."""
    prefilled = []

    class Count:
        @hookimpl
        def step_finished(self, stats):
            prefilled.append(stats.num_prefill_tokens)

    for cache in ("paged", "radix", "contiguous"):
        prefilled.clear()
        pm = PluginManager(load_entry_points=False, extra=[Count()])
        with LLM(flags=tiny_engine_kwargs(tiny_model_dir, cache_manager=cache), plugin_manager=pm) as llm:
            ids = llm.engine.prompt_ids(PROMPT)
            params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True, n=4)
            outs = llm.generate(PROMPT, params)
            assert [o.index for o in outs] == [0, 1, 2, 3]
            assert [o.request_id.split("#")[1:] for o in outs] == [[], ["1"], ["2"], ["3"]]
            assert all(len(o.token_ids) == 10 and o.finish_reason == "length" for o in outs)
            n_prefill = sum(prefilled)
            assert llm.engine.stats()["prompt_tokens"] == len(ids)
            alone = [llm.generate(PROMPT, msgspec.structs.replace(params, n=1, seed=11 + i))[0] for i in range(4)]
            assert [o.token_ids for o in outs] == [a.token_ids for a in alone], cache
            assert len({tuple(o.token_ids) for o in outs}) > 1
            if cache != "contiguous":  # (contiguous shares nothing: each fork prefills for itself)
                assert n_prefill == len(ids), (cache, n_prefill)
            _blocks_back(llm.engine)


def test_n_greedy_samples_agree_and_decoders_and_short_ends_hold(llm):
    outs = llm.generate(PROMPT, msgspec.structs.replace(GREEDY, n=3, decoder="ngram"))
    single = llm.generate(PROMPT, GREEDY)[0].token_ids
    assert [o.token_ids for o in outs] == [single] * 3
    one = llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=1, n=5, ignore_eos=True))
    assert [len(o.token_ids) for o in one] == [1] * 5  # forks that end on their first token never hold a block
    aligned = "x" * 32  # a prompt of whole blocks: nothing to copy
    got = llm.generate(aligned, SamplingParams(temperature=1.0, seed=2, max_tokens=6, n=3, ignore_eos=True))
    want = [llm.generate(aligned, SamplingParams(temperature=1.0, seed=2 + i, max_tokens=6, ignore_eos=True))[0]
            for i in range(3)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    with pytest.raises(ClientError) as info:
        llm.generate("hi", SamplingParams(n=0))
    assert info.value.param == "n"
    _blocks_back(llm.engine)


async def test_abort_mid_stream_and_before_the_fork_end_every_sample_once(tiny_model_dir):
    pm = PluginManager(load_entry_points=False, extra=[SlowSteps()])
    engine = AsyncEngine(config_from_sources(pm, None, None, tiny_engine_kwargs(tiny_model_dir)), plugin_manager=pm)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True, n=3)
        queue: asyncio.Queue = asyncio.Queue()
        req = engine.submit(PROMPT, params, request_id="g", sink=queue)
        assert [s.request_id for s in req.samples] == ["g", "g#1", "g#2"]
        seen: dict[str, int] = {}
        while len(seen) < 3:  # every sample streams
            item = await queue.get()
            if isinstance(item, TokenDelta) and item.token_ids:
                seen[item.request_id] = seen.get(item.request_id, 0) + 1
        assert engine.cache.stats().num_used_blocks > 0
        for s in req.samples:
            engine.abort(s.request_id)
        finals = await _finals(queue, 3)
        assert sorted(f.index for f in finals) == [0, 1, 2] and {f.finish_reason for f in finals} == {"aborted"}
        await asyncio.sleep(0.05)
        assert queue.empty()  # exactly one Finished each
        _blocks_back(engine)

        # sample 0 aborted before its prefill is done: the forks go on without it
        req = engine.submit(PROMPT, msgspec.structs.replace(params, max_tokens=5), request_id="h", sink=queue)
        engine.abort("h")
        finals = await _finals(queue, 3)
        by_index = {f.index: f for f in finals}
        assert by_index[0].finish_reason == "aborted"
        assert [len(by_index[i].token_ids) for i in (1, 2)] == [5, 5]
        _blocks_back(engine)

        # engine.generate interleaves the samples and ends after the last one's Finished
        items = [i async for i in engine.generate(PROMPT, msgspec.structs.replace(params, max_tokens=4))]
        assert sum(isinstance(i, Finished) for i in items) == 3 and isinstance(items[-1], Finished)
        _blocks_back(engine)
    finally:
        await engine.shutdown()
        engine.close()


async def _finals(queue: asyncio.Queue, count: int) -> list[Finished]:
    finals = []
    while len(finals) < count:
        item = await asyncio.wait_for(queue.get(), 10)
        if isinstance(item, Finished):
            finals.append(item)
    return finals


# ---- the OpenAI frontend ----------------------------------------------------------------------------
@pytest.fixture
async def server(tiny_model_dir):
    pm = PluginManager(load_entry_points=False, extra=[SlowSteps(0.002)])
    frontends = {"enabled": ["openai"], "openai": {"port": 0}}
    engine = AsyncEngine(config_from_sources(pm, None, None, tiny_engine_kwargs(tiny_model_dir, frontends=frontends)),
                         plugin_manager=pm)
    host = FrontendHost(engine, ServerOptions())
    await host.start()
    base = host.frontends[0].urls()[0]
    yield engine, base, openai.AsyncOpenAI(base_url=base, api_key="k", max_retries=0), engine.config.engine.model
    await host.shutdown(0)
    await engine.shutdown()
    engine.close()


async def _idle(engine, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if engine.num_unfinished == 0 and engine.cache.stats().num_used_blocks == 0:
            engine.cache.check_integrity()
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not idle: {engine.num_unfinished} requests, {engine.cache.stats()}")


HI = [{"role": "user", "content": "hello there"}]


async def test_openai_n_choices_whole_and_streamed(server):
    engine, base, client, model = server
    whole = await client.chat.completions.create(model=model, messages=HI, n=3, max_tokens=6, seed=4,
                                                 extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in whole.choices)
    prompt_tokens = len(engine.prompt_ids(messages=HI))
    assert whole.usage.prompt_tokens == prompt_tokens and whole.usage.completion_tokens == 18

    # streamed: every chunk names its choice, each choice one finish chunk, one [DONE] at the end
    body = {"model": model, "messages": HI, "n": 3, "max_tokens": 6, "seed": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    events = await asyncio.to_thread(_sse, base + "/chat/completions", body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    texts, finishes = {0: "", 1: "", 2: ""}, {0: [], 1: [], 2: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert texts == {c.index: c.message.content for c in whole.choices}  # seeded: the same samples
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == 18
    await _idle(engine)


async def test_openai_best_of_logit_bias_and_refusals(server):
    engine, base, client, model = server
    out = await client.completions.create(model=model, prompt=PROMPT, n=2, best_of=4, max_tokens=5,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1] and all(c.logprobs is None for c in out.choices)
    assert out.usage.completion_tokens == 20  # every sample run
    # the best of: each returned choice's cumulative logprob beats the ones left out
    ranked = await client.completions.create(model=model, prompt=PROMPT, n=1, best_of=3, max_tokens=4, logprobs=0,
                                             seed=9, extra_body={"ignore_eos": True})
    all3 = await client.completions.create(model=model, prompt=PROMPT, n=3, max_tokens=4, logprobs=0, seed=9,
                                           extra_body={"ignore_eos": True})
    best = max(all3.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert ranked.choices[0].text == best.text

    plain = [i async for i in engine.generate(PROMPT, GREEDY)][-1].token_ids
    biased = await client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                             logit_bias={str(t): -100 for t in plain}, extra_body={"ignore_eos": True})
    spelled = {schema.token_text(engine.tokenizer, t)[0] for t in plain}
    assert len(biased.choices[0].logprobs.tokens) == 12 and not spelled & set(biased.choices[0].logprobs.tokens)
    chat = await client.chat.completions.create(model=model, messages=HI, max_tokens=4, temperature=0,
                                                logit_bias={"65": 100})
    assert chat.choices[0].message.content == "b" * 4  # token 65 is the byte "b"

    for kwargs, param in [({"logit_bias": {"x1": 5}}, "logit_bias"), ({"logit_bias": {"9999": 5}}, "logit_bias"),
                          ({"logit_bias": {"5": -101}}, "logit_bias"), ({"n": 3, "best_of": 2}, "best_of"),
                          ({"best_of": 3, "stream": True}, "best_of"), ({"n": 200}, "n"), ({"max_tokens": 0}, "max_tokens")]:
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model=model, prompt="x", **{"max_tokens": 2, **kwargs})
        assert info.value.body["param"] == param, kwargs
    await _idle(engine)


async def test_openai_n_abort_mid_stream_gives_every_block_back(server):
    engine, base, client, model = server
    stream = await client.chat.completions.create(model=model, messages=HI, n=3, max_tokens=600, stream=True,
                                                  extra_body={"ignore_eos": True})
    seen = set()
    async for chunk in stream:
        seen.update(c.index for c in chunk.choices if c.delta.content)
        if seen == {0, 1, 2}:
            break
    assert engine.cache.stats().num_used_blocks > 0
    await stream.close()
    await _idle(engine)


async def test_websocket_takes_logit_bias_and_refuses_n(make_server):
    server, url = await make_server()
    async with Client(url) as client:
        events = [e async for e in client.generate(PROMPT, params={"temperature": 0, "max_tokens": 5,
                                                                   "ignore_eos": True, "logit_bias": {65: 100}})]
        assert [t for e in events[:-1] for t in e.token_ids] == [65] * 5
        with pytest.raises(RequestError) as info:
            _ = [e async for e in client.generate(PROMPT, params={"n": 2})]
        assert info.value.param == "n"
        with pytest.raises(RequestError) as info:
            _ = [e async for e in client.generate(PROMPT, params={"logit_bias": {300: 1.0}})]
        assert info.value.param == "logit_bias"


def _sse(url: str, body: dict) -> list[str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
