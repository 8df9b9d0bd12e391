"""Same KV memory, requests that reserve 512 tokens but stop near 100: paging holds more."""

from __future__ import annotations

import random

import pytest

from tokenloom import SamplingParams

# tiny-model engines: one torch thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

NUM_BLOCKS = 400  # 6,400 token slots


def _run(make_llm, cache):
    llm = make_llm(num_kv_blocks=NUM_BLOCKS, cache_manager=cache,
                   scheduler={"name": "continuous", "max_num_seqs": 64, "max_num_batched_tokens": 1024})
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randrange(10, 30))] for _ in range(64)]
    # Four "end" tokens make an early stop likely (~1/60 per token at temperature 1), so
    # requests stop after tens to a few hundred tokens, like chat answers under max_tokens 512.
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=512, stop_token_ids=[10, 32, 101, 116])
              for i in range(64)]
    outs = llm.generate(prompts, params)
    lengths = [len(o.token_ids) for o in outs]
    return llm.engine.counters.peak_running, lengths


def test_paged_runs_at_least_twice_the_sequences(make_llm):
    paged_peak, paged_lengths = _run(make_llm, "paged")
    contiguous_peak, contiguous_lengths = _run(make_llm, "contiguous")
    assert paged_lengths == contiguous_lengths  # same work, same outputs (seeded)
    mean = sum(paged_lengths) / len(paged_lengths)
    assert 30 < mean < 250, mean
    # contiguous reserves ceil((prompt + 512) / 16) >= 33 blocks: at most 12 at once
    assert contiguous_peak <= NUM_BLOCKS // 33
    assert paged_peak >= 2 * contiguous_peak, (paged_peak, contiguous_peak)
    print(f"peak concurrent sequences: paged {paged_peak}, contiguous {contiguous_peak}, "
          f"mean output {mean:.0f} tokens")


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_waste_statistic(make_llm, cache):
    llm = make_llm(cache_manager=cache)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))
    stats = llm.engine.cache.stats()
    assert stats.num_used_blocks == 0 and stats.waste == 0.0
