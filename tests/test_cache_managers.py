"""Cache-manager contract, run against every built-in manager."""

from __future__ import annotations

import random

import pytest

from tokenloom.core.interfaces import CacheManager
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Sequence
from tokenloom.plugins.cache.contiguous import ContiguousCacheManager
from tokenloom.plugins.cache.paged import PagedCacheManager
from tokenloom.plugins.cache.radix import RadixCacheManager

MANAGERS = {"paged": PagedCacheManager, "radix": RadixCacheManager, "contiguous": ContiguousCacheManager}


def _seq(prompt_len, max_tokens=32):
    return Sequence("r", [1] * prompt_len, SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize("name", MANAGERS)
def test_satisfies_protocol(name):
    assert isinstance(MANAGERS[name](None, 8, 16), CacheManager)


@pytest.mark.parametrize("name", MANAGERS)
def test_random_operations_keep_integrity(name):
    rng = random.Random(name)
    cache = MANAGERS[name](None, 40, 4)
    live: list[Sequence] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.4 or not live:
            seq = _seq(rng.randrange(1, 20), rng.randrange(1, 30))
            if cache.can_ever_fit(seq):
                before = cache.stats()
                ok = cache.allocate(seq, seq.num_prompt_tokens)
                if ok:
                    live.append(seq)
                else:  # all or nothing
                    after = cache.stats()  # (radix may have evicted cached blocks trying)
                    assert (after.num_used_blocks, after.num_available_blocks) == \
                        (before.num_used_blocks, before.num_available_blocks)
                    assert cache.block_table(seq) == []
        elif op < 0.8:
            seq = rng.choice(live)
            seq.num_computed_tokens = seq.num_tokens
            if seq.num_tokens < seq.max_len:
                can = cache.can_allocate(seq, 1)
                assert cache.allocate(seq, 1) == can
                if can:
                    seq.append_token(7)
        else:
            seq = live.pop(rng.randrange(len(live)))
            cache.free(seq)
            assert cache.block_table(seq) == []
        cache.check_integrity()
        for seq in live:
            assert len(cache.block_table(seq)) * cache.block_size >= seq.num_computed_tokens
        stats = cache.stats()
        assert stats.num_used_blocks == cache.num_used_blocks == len({b for s in live for b in cache.block_table(s)})
        assert stats.num_free_blocks == cache.num_free_blocks
    for seq in live:
        cache.free(seq)
    cache.check_integrity()
    stats = cache.stats()
    assert stats.num_used_blocks == 0 and stats.num_available_blocks == 40


def test_paged_takes_only_the_blocks_it_fills():
    cache = PagedCacheManager(None, 10, 4)
    seq = _seq(5, max_tokens=100)
    assert cache.allocate(seq, 5) and len(cache.block_table(seq)) == 2
    s = cache.stats()
    assert s.num_tokens_stored == 5 and s.num_reserved_slots == 8 and s.waste == pytest.approx(3 / 8)


def test_contiguous_reserves_max_length_in_one_run():
    cache = ContiguousCacheManager(None, 10, 4)
    a, b = _seq(3, max_tokens=9), _seq(2, max_tokens=2)  # 3 blocks, 1 block
    assert cache.allocate(a, 3) and cache.block_table(a) == [0, 1, 2]
    assert cache.allocate(b, 2) and cache.block_table(b) == [3]
    cache.free(a)
    c = _seq(10, max_tokens=14)  # 6 blocks: does not fit in the hole at 0..2
    assert cache.allocate(c, 10) and cache.block_table(c) == [4, 5, 6, 7, 8, 9]
    assert not cache.can_allocate(_seq(10, max_tokens=6), 10)  # 4 blocks: no run that long
    cache.check_integrity()
