"""Prompt logprobs (`SamplingParams.prompt_logprobs`) and the completions endpoint's `echo`:
the prompt's logprobs are the ones `tokenloom eval perplexity` scores (core/evaluation.py),
and lm-eval's loglikelihood request (`echo=True, max_tokens=0, logprobs=1`) works."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.core.build import config_from_sources
from tokenloom.core.engine import AsyncEngine
from tokenloom.core.errors import ClientError
from tokenloom.core.evaluation import perplexity
from tokenloom.core.plugins import PluginManager
from tokenloom.protocols.gateway import FrontendHost, ServerOptions

from conftest import tiny_engine_kwargs

openai = pytest.importorskip("openai")

TEXT = "Paris is the capital of France."


def _eval_logprobs(engine, ids: list[int], upto: int | None = None) -> list[float]:
    """Each token's logprob (of the first ``upto``) through the eval path alone: the total
    NLL of each prefix (``perplexity`` over one window), differenced."""
    totals = [0.0]
    for k in range(2, (upto or len(ids)) + 1):
        r = perplexity(engine, ids[:k], window=k)
        totals.append(r["nll"] * r["tokens"])
    return [-(b - a) for a, b in zip(totals, totals[1:], strict=False)]


def test_prompt_logprobs_are_the_eval_paths(tiny_model_dir):
    with LLM(**tiny_engine_kwargs(tiny_model_dir)) as llm:
        ids = llm.engine.prompt_ids(TEXT)
        out = llm.generate(TEXT, SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
        assert out.finish_reason == "length" and out.token_ids == [] and out.usage.completion_tokens == 0
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None
        assert [e.token_id for e in lps[1:]] == ids[1:]
        want = _eval_logprobs(llm.engine, ids, upto=8)
        assert max(abs(e.logprob - w) for e, w in zip(lps[1:8], want, strict=True)) < 1e-4
        whole = perplexity(llm.engine, ids, window=len(ids))
        assert abs(-sum(e.logprob for e in lps[1:]) - whole["nll"] * whole["tokens"]) < 1e-4
        assert all(len(e.top) == 3 and e.top[0].logprob >= e.logprob - 1e-9 for e in lps[1:])

        # with tokens to generate too: the same prompt logprobs, then the completion; n samples
        # carry them on sample 0
        outs = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0, n=2,
                                                 ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [4, 4] and outs[1].prompt_logprobs is None
        assert [e.logprob for e in outs[0].prompt_logprobs[1:]] == pytest.approx([e.logprob for e in lps[1:]],
                                                                                  abs=1e-9)
        for bad in (SamplingParams(max_tokens=0), SamplingParams(prompt_logprobs=21)):
            with pytest.raises(ClientError):
                llm.generate(TEXT, bad)
        assert llm.engine.cache.stats().num_used_blocks == 0
        llm.engine.cache.check_integrity()


@pytest.fixture
async def server(tiny_model_dir):
    pm = PluginManager(load_entry_points=False)
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


async def test_lm_eval_loglikelihood_request(server):
    """``echo=True, max_tokens=0, logprobs=1``: the prompt back, each token's logprob (the
    first ``None``) equal to the eval path's, its top alternative, offsets into the text."""
    engine, _, client, model = server
    out = await client.completions.create(model=model, prompt=TEXT, echo=True, max_tokens=0, logprobs=1)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(TEXT)
    assert "".join(lp.tokens) == TEXT and lp.text_offset == list(range(len(TEXT)))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = await asyncio.to_thread(_eval_logprobs, engine, engine.prompt_ids(TEXT))
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want, strict=True)) < 1e-4
    assert all(len(t) == 1 and max(t.values()) >= v - 1e-9 for t, v in zip(lp.top_logprobs[1:],
                                                                            lp.token_logprobs[1:], strict=True))
    # the same through token ids as the prompt
    ids = engine.prompt_ids(TEXT)
    again = await client.completions.create(model=model, prompt=ids, echo=True, max_tokens=0, logprobs=1)
    assert again.choices[0].text == TEXT and again.choices[0].logprobs.token_logprobs == lp.token_logprobs


async def test_echo_with_a_completion_whole_streamed_and_n(server):
    engine, base, client, model = server
    kw = {"model": model, "prompt": TEXT, "echo": True, "max_tokens": 5, "temperature": 0, "logprobs": 2}
    whole = await client.completions.create(**kw, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(TEXT) and len(lp.tokens) == len(TEXT) + 5
    assert lp.text_offset[:len(TEXT)] == list(range(len(TEXT)))
    assert lp.text_offset[len(TEXT)] == len(TEXT) and lp.text_offset == sorted(lp.text_offset)
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert whole.usage.completion_tokens == 5

    plain = await client.completions.create(model=model, prompt=TEXT, echo=True, max_tokens=5, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None

    events = await asyncio.to_thread(_sse, base + "/completions", {**kw, "stream": True, "ignore_eos": True, "n": 2})
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    firsts = [next(c for c in chunks if c["index"] == i) for i in (0, 1)]
    assert all(c["text"] == TEXT and c["logprobs"]["token_logprobs"][0] is None for c in firsts)
    texts = {i: "".join(c["text"] for c in chunks if c["index"] == i) for i in (0, 1)}
    assert texts == {0: choice.text, 1: choice.text}  # greedy: both samples the same
    tokens = [t for c in chunks if c["index"] == 0 and c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == lp.tokens

    n2 = await client.completions.create(**{**kw, "logprobs": None}, n=2, extra_body={"ignore_eos": True})
    assert [c.text for c in n2.choices] == [choice.text] * 2
    for _ in range(100):
        if engine.num_unfinished == 0 and engine.cache.stats().num_used_blocks == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.cache.stats().num_used_blocks == 0


def _sse(url: str, body: dict) -> list[str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
