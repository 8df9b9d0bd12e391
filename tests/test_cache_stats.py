"""CacheStats: used / cached / free blocks mean the same for every cache manager (issue 14).

used: held by a live sequence (cannot be reclaimed); cached: reusable prefix KV nobody
holds (eviction reclaims it); free: holds nothing. ``usage`` (the engine's ``kv_usage``)
is used / total, so an idle cache full of reusable prefixes reads 0.0, not "full".
"""

from __future__ import annotations

import pytest

from tokenloom.core.interfaces import CacheStats
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Sequence
from tokenloom.plugins.cache.contiguous import ContiguousCacheManager
from tokenloom.plugins.cache.paged import PagedCacheManager, PagedOptions
from tokenloom.plugins.cache.radix import RadixCacheManager

NUM_BLOCKS, BS = 32, 4
MANAGERS = {  # name -> (factory, keeps prefixes for reuse)
    "paged": (lambda n, bs: PagedCacheManager(PagedOptions(enable_prefix_caching=True), n, bs), True),
    "paged-nocache": (lambda n, bs: PagedCacheManager(PagedOptions(enable_prefix_caching=False), n, bs), False),
    "radix": (lambda n, bs: RadixCacheManager(None, n, bs), True),
    "contiguous": (lambda n, bs: ContiguousCacheManager(None, n, bs), False),
}


def _kept_for_reuse(cache) -> int:
    """Blocks the prefix cache holds, however the manager stores them."""
    if isinstance(cache, PagedCacheManager):
        return len(cache._meta)
    if isinstance(cache, RadixCacheManager):
        return len({b for n in cache._iter_nodes() for b in n.blocks})
    return 0


def _check(cache) -> CacheStats:
    """The three counts are disjoint, cover the pool, and agree with the cheap properties."""
    s = cache.stats()
    assert min(s.num_used_blocks, s.num_cached_blocks, s.num_free_blocks) >= 0
    assert s.num_used_blocks + s.num_cached_blocks + s.num_free_blocks == s.num_blocks == cache.num_blocks
    assert s.num_available_blocks == s.num_cached_blocks + s.num_free_blocks
    assert (cache.num_used_blocks, cache.num_free_blocks) == (s.num_used_blocks, s.num_free_blocks)
    assert s.usage == s.num_used_blocks / s.num_blocks
    cache.check_integrity()
    return s


def _admit(cache, seq: Sequence) -> None:
    """As the scheduler does: claim a cached prefix, allocate the rest, run the prefill."""
    seq.num_computed_tokens = cache.claim_prefix(seq)
    assert cache.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    seq.append_token(7)  # the sampled token: its KV is computed by the next step


def _decode(cache, seq: Sequence, tok: int) -> None:
    assert cache.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    seq.append_token(tok)


def _requests():
    stem = list(range(20, 30))  # 10 shared tokens: two full blocks and a half
    return [Sequence(f"r{i}", stem + tail, SamplingParams(max_tokens=8))
            for i, tail in enumerate(([1, 2, 3], [4, 5, 6, 7], [8] * 7))]


@pytest.mark.parametrize("name", MANAGERS)
def test_block_states_through_request_lifecycles(name):
    factory, caching = MANAGERS[name]
    cache = factory(NUM_BLOCKS, BS)
    s = _check(cache)
    assert (s.num_used_blocks, s.num_cached_blocks, s.num_free_blocks) == (0, 0, NUM_BLOCKS)

    for wave in range(2):  # the second wave finds the first one's prefixes (where cached)
        running = _requests()
        for seq in running:
            _admit(cache, seq)
            s = _check(cache)
            assert s.num_used_blocks > 0 and s.usage > 0.0
        if wave and caching:
            assert all(seq.num_computed_tokens for seq in running)
            assert cache.stats().prefix_hits > 0
        for step in range(3):
            for seq in running:
                _decode(cache, seq, step)
                held = {b for r in running for b in cache.block_table(r)}
                s = _check(cache)
                assert s.num_used_blocks >= len(held) > 0
                if not isinstance(cache, RadixCacheManager):  # (radix also locks tree nodes)
                    assert s.num_used_blocks == len(held)
        while running:  # finish, one by one
            cache.free(running.pop(0))
            s = _check(cache)
            assert (s.num_used_blocks > 0) == bool(running)

        s = _check(cache)
        assert s.num_used_blocks == 0 and s.usage == 0.0
        assert s.num_cached_blocks == _kept_for_reuse(cache)
        assert (s.num_cached_blocks > 0) == caching
        assert s.num_free_blocks == NUM_BLOCKS - s.num_cached_blocks
        assert s.num_available_blocks == NUM_BLOCKS


@pytest.mark.parametrize("name", ["radix", "paged"])
def test_idle_prefix_cache_is_not_in_use(name):
    """Issue 14: an idle radix cache reported its reusable blocks as used (kv_usage 0.875)."""
    cache = MANAGERS[name][0](8, BS)
    seq = Sequence("r", list(range(28)), SamplingParams(max_tokens=4))  # 7 full blocks
    _admit(cache, seq)
    s = cache.stats()
    assert s.num_used_blocks == 7 and s.num_free_blocks == 1 and s.usage == 7 / 8
    cache.free(seq)
    s = cache.stats()  # (the fields the engine reports, before the new ones)
    assert s.usage == 0.0 and s.num_used_blocks == 0, f"idle cache reads {s.usage:.3f} in use"
    s = _check(cache)
    assert s.num_cached_blocks == 7 and s.num_free_blocks == 1 and s.num_available_blocks == 8
    # cached means reclaimable: a request may take the whole pool, evicting the prefixes
    big = Sequence("big", [99] * (8 * BS), SamplingParams(max_tokens=1))
    assert cache.can_allocate(big, big.num_tokens) and cache.allocate(big, big.num_tokens)
    s = _check(cache)
    assert (s.num_used_blocks, s.num_cached_blocks, s.num_free_blocks) == (8, 0, 0)
    assert s.num_evictions > 0 and s.usage == 1.0


def test_radix_copy_source_is_used_while_its_reader_runs():
    """A prefix ending inside a block is copied from a block only the tree holds; the
    running request locks that block, so it counts as used, not cached."""
    cache = RadixCacheManager(None, 8, BS)
    first = Sequence("a", list(range(10)), SamplingParams(max_tokens=2))
    _admit(cache, first)
    cache.free(first)  # the tree keeps the 10 computed tokens, in 3 blocks
    s = _check(cache)
    assert s.num_used_blocks == 0 and s.num_cached_blocks == 3
    second = Sequence("b", list(range(6)) + [50, 51], SamplingParams(max_tokens=2))
    assert cache.claim_prefix(second) == 6  # block 0 shared, 2 tokens of block 1 copied
    assert cache.take_copies()
    s = _check(cache)
    table = cache.block_table(second)
    assert len(table) == 2 and s.num_used_blocks == 3  # its 2 blocks + the locked copy source
    assert s.num_cached_blocks == 1  # the last block, which nobody locked
    cache.free(second)
    assert _check(cache).num_used_blocks == 0


def test_cache_stats_counts_and_properties():
    s = CacheStats(num_blocks=10, num_free_blocks=3, block_size=4, num_tokens_stored=6,
                   num_reserved_slots=8, num_cached_blocks=5)
    assert s.num_used_blocks == 2 and s.num_available_blocks == 8 and s.usage == 0.2
    assert s.waste == 0.25
    assert CacheStats(0, 0, 4, 0, 0).usage == 0.0
    assert not hasattr(s, "__dict__")  # still slotted
