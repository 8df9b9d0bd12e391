"""One contract, every cache manager: hypothesis drives random allocate / append / fork /
free / match / evict sequences and checks the bookkeeping after every operation."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenloom.core.interfaces import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.sequence import Sequence
from tokenloom.plugins.cache.contiguous import ContiguousCacheManager
from tokenloom.plugins.cache.paged import PagedCacheManager, PagedOptions
from tokenloom.plugins.cache.radix import RadixCacheManager

NUM_BLOCKS, BLOCK_SIZE = 24, 4
# a small alphabet and shared stems make prefix hits (and radix splits) frequent
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=14)
stems = st.sampled_from([[], [1, 2, 3, 0, 1], [1, 2, 3, 0, 1, 2, 2, 3, 1], [3, 3, 3, 3]])

FACTORIES = {
    "paged": lambda: PagedCacheManager(PagedOptions(enable_prefix_caching=True), NUM_BLOCKS, BLOCK_SIZE),
    "paged-nocache": lambda: PagedCacheManager(PagedOptions(enable_prefix_caching=False), NUM_BLOCKS, BLOCK_SIZE),
    "radix": lambda: RadixCacheManager(None, NUM_BLOCKS, BLOCK_SIZE),
    "contiguous": lambda: ContiguousCacheManager(None, NUM_BLOCKS, BLOCK_SIZE),
}
PREFIX_CACHING = {"paged", "radix"}  # the others never hold a cached block


class CacheContract(RuleBasedStateMachine):
    factory = None
    caching = True

    @initialize()
    def setup(self):
        self.cache = type(self).factory()
        self.live: list[Sequence] = []
        self.salts = [None, "tenant"]

    def _admit(self, seq: Sequence) -> None:
        seq.num_computed_tokens = self.cache.claim_prefix(seq)
        assert seq.num_computed_tokens < seq.num_tokens
        if self.cache.allocate(seq, seq.num_tokens - seq.num_computed_tokens):
            seq.num_computed_tokens = seq.num_tokens - 1  # "ran": all but the newest token computed
            self.live.append(seq)
        else:
            self.cache.free(seq)

    @rule(stem=stems, tail=tokens, max_tokens=st.integers(1, 12), salt=st.sampled_from([None, "t"]))
    def admit(self, stem, tail, max_tokens, salt):
        seq = Sequence("r", stem + tail, SamplingParams(max_tokens=max_tokens), cache_salt=salt)
        if self.cache.can_ever_fit(seq):
            peek = self.cache.match_prefix(seq)
            self._admit(seq)
            assert peek <= seq.num_tokens - 1

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), tok=st.integers(0, 3))
    def append(self, i, tok):
        seq = self.live[i % len(self.live)]
        if seq.num_tokens >= seq.max_len:
            return
        seq.num_computed_tokens = seq.num_tokens  # the previous step computed everything
        seq.append_token(tok)
        seq.num_computed_tokens -= 1
        if not self.cache.allocate(seq, 1 + (seq.num_tokens - 1 - seq.num_computed_tokens)):
            self.live.remove(seq)  # preempted
            self.cache.free(seq)
        else:
            seq.num_computed_tokens = seq.num_tokens - 1

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), extra=tokens)
    def fork(self, i, extra):
        parent = self.live[i % len(self.live)]
        child = Sequence("f", parent.token_ids[:parent.num_computed_tokens] + extra,
                         SamplingParams(max_tokens=4), cache_salt=parent.cache_salt)
        if not self.cache.can_ever_fit(child):
            return
        shared = self.cache.fork(parent, child)
        assert shared < child.num_tokens  # (radix may share more than the parent computed)
        child.num_computed_tokens = shared
        if self.cache.allocate(child, child.num_tokens - shared):
            child.num_computed_tokens = child.num_tokens - 1
            self.live.append(child)
        else:
            self.cache.free(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        seq = self.live.pop(i % len(self.live))
        self.cache.free(seq)
        assert self.cache.block_table(seq) == []

    @rule(n=st.integers(1, NUM_BLOCKS))
    def pressure(self, n):
        """Evict: a request that needs many blocks forces cached ones out (where any)."""
        seq = Sequence("big", [9] * (n * BLOCK_SIZE), SamplingParams(max_tokens=1))
        if self.cache.allocate(seq, seq.num_tokens):
            self.cache.check_integrity()
        self.cache.free(seq)

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        for seq in self.live:
            assert len(self.cache.block_table(seq)) * BLOCK_SIZE >= seq.num_computed_tokens + 1
        self.check_block_states()

    def _held_blocks(self) -> set[int]:
        """Blocks no eviction may take: those in live sequences' block tables, and in
        ``radix`` those of the tree nodes a running sequence locked (e.g. the source of
        a partial-block copy, which is in no table)."""
        held = {b for seq in self.live for b in self.cache.block_table(seq)}
        if isinstance(self.cache, RadixCacheManager):
            for node in self.cache._locked.values():
                held.update(b for n in self.cache._path(node) for b in n.blocks)
        return held

    def check_block_states(self):
        """used / cached / free: disjoint, summing to the pool, the same meaning everywhere."""
        cache, stats = self.cache, self.cache.stats()
        used, cached, free = stats.num_used_blocks, stats.num_cached_blocks, stats.num_free_blocks
        assert min(used, cached, free) >= 0 and stats.num_blocks == NUM_BLOCKS
        assert used + cached + free == NUM_BLOCKS
        assert used == len(self._held_blocks()), "used != blocks live sequences hold"
        assert (cache.num_used_blocks, cache.num_free_blocks) == (used, free), "cheap counts disagree"
        assert stats.usage == used / NUM_BLOCKS
        states = cache.block_states()  # the per-block map says the same, block by block
        assert len(states) == NUM_BLOCKS
        assert {b for b, s in enumerate(states) if s == BLOCK_USED} == self._held_blocks()
        assert (states.count(BLOCK_CACHED), states.count(BLOCK_FREE)) == (cached, free)
        if not self.caching:
            assert cached == 0
        if not isinstance(cache, ContiguousCacheManager):  # (contiguous needs a run, not a count)
            # cached blocks are reclaimable: a new request may take every available block, no more
            avail = stats.num_available_blocks
            if avail:
                assert cache.can_allocate(self._probe(avail), avail * BLOCK_SIZE)
            assert not cache.can_allocate(self._probe(avail + 1), (avail + 1) * BLOCK_SIZE)

    @staticmethod
    def _probe(num_blocks: int) -> Sequence:
        return Sequence("probe", [5] * (num_blocks * BLOCK_SIZE), SamplingParams(max_tokens=1))

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for seq in self.live:
            self.cache.free(seq)
        self.live = []
        self.cache.check_integrity()
        self.check_block_states()
        stats = self.cache.stats()
        assert stats.num_used_blocks == 0 and stats.usage == 0.0
        # everything a sequence held came back; what remains is only reclaimable cache
        big = Sequence("all", [7] * (NUM_BLOCKS * BLOCK_SIZE - 1), SamplingParams(max_tokens=1))
        assert self.cache.allocate(big, big.num_tokens), "blocks leaked"
        self.cache.free(big)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_cache_manager_contract(name):
    machine = type(f"Contract_{name}", (CacheContract,),
                   {"factory": staticmethod(FACTORIES[name]), "caching": name in PREFIX_CACHING})
    machine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    machine.TestCase().runTest()


@pytest.mark.parametrize(("name", "can"), [("paged", True), ("contiguous", True), ("radix", False)])
def test_prefix_caching_turns_off_through_the_registered_options(name, can):
    """A draft model's pool is built from the registry with ``PREFIX_CACHING_OPTION`` false
    (core/build.py): ``paged`` declares it, ``contiguous`` never caches; ``radix`` always
    does and is refused with a sentence, not built with its cache on."""
    from tokenloom.core.build import SECOND_MODEL_CACHE_MANAGER, cache_without_prefix_caching
    from tokenloom.core.errors import ConfigError
    from tokenloom.core.plugins import PluginManager

    pm = PluginManager(load_entry_points=False)
    assert SECOND_MODEL_CACHE_MANAGER == "paged"
    if can:
        cache = cache_without_prefix_caching(pm, name, NUM_BLOCKS, BLOCK_SIZE)
        assert cache.prefix_caching is False and cache.num_blocks == NUM_BLOCKS
    else:
        with pytest.raises(ConfigError, match="enable_prefix_caching"):
            cache_without_prefix_caching(pm, name, NUM_BLOCKS, BLOCK_SIZE)
