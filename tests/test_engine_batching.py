"""Continuous batching must not change what greedy decoding produces."""

from __future__ import annotations

import random

import pytest

from tokenloom import SamplingParams

# tiny-model engines, the shared one included: one torch thread (conftest.one_thread_module)
pytestmark = pytest.mark.usefixtures("one_thread_module")

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


@pytest.fixture(scope="module")
def alone_outputs(tiny_model_dir, one_thread_module):
    from tokenloom import LLM

    from conftest import tiny_engine_kwargs

    with LLM(**tiny_engine_kwargs(tiny_model_dir)) as llm:
        return [llm.generate([p], GREEDY)[0].token_ids for p in _prompts(16)]


@pytest.mark.parametrize("chunked", [True, False])
def test_sixteen_prompts_together_equal_alone(make_llm, alone_outputs, chunked):
    # A small token budget forces chunked prefill to split prompts and mix them with decodes.
    llm = make_llm(scheduler={"name": "continuous", "max_num_batched_tokens": 80 if chunked else 128,
                              "enable_chunked_prefill": chunked})
    outs = llm.generate(_prompts(16), GREEDY)
    assert [o.token_ids for o in outs] == alone_outputs
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.engine.counters.peak_running > 1  # they really ran together


def test_static_scheduler_equal_alone(make_llm, alone_outputs):
    llm = make_llm(scheduler={"name": "static", "max_num_seqs": 5}, cache_manager="contiguous")
    outs = llm.generate(_prompts(16), GREEDY)
    assert [o.token_ids for o in outs] == alone_outputs
