"""`paged`: PagedAttention's block pool with automatic prefix caching (vLLM's design).

A sequence holds exactly the blocks its tokens fill (the last one partly), taken from a
free pool, so memory is wasted only in each sequence's last block. With prefix caching
on, every *computed* full block is registered under a hash that chains the previous
block's hash with this block's token ids (and the request's ``cache_salt``); a new
request claims the longest run of registered blocks matching its prompt (confirmed
against the stored token ids, so a hash collision cannot serve wrong KV). Freed blocks
keep their hash and stay claimable until the pool needs them: the free queue is LRU,
tail blocks of a sequence first, and reusing a registered block evicts it.

Block states (see ``CacheStats``): *used* blocks have a reference count above zero;
the free queue holds the rest, *cached* ones (still registered) and *free* ones.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED, CacheStats
from tokenloom.core.sequence import Sequence
from tokenloom.core.utils import cdiv


class PagedOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    enable_prefix_caching: bool = True


@dataclass(slots=True)
class _Cached:
    """What a registered block holds: its chain hash, its parent's, and its tokens."""

    key: int
    parent: int | None
    tokens: tuple[int, ...]


def block_key(parent: int | None, tokens: tuple[int, ...], salt: str | None) -> int:
    return hash((parent, salt, tokens))


class PagedCacheManager:
    def __init__(self, options: PagedOptions | None, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = (options or PagedOptions()).enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU order
        self._ref = [0] * num_blocks
        self._meta: dict[int, _Cached] = {}  # block id -> registration
        self._by_key: dict[int, int] = {}  # chain hash -> block id
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}
        self._lookahead: dict[int, int] = {}  # slots held past the tokens for drafts (max so far)
        self._registered: dict[int, tuple[int, int | None]] = {}  # seq -> (blocks done, last chain hash)
        self._num_cached = 0  # blocks in the free queue that are still registered
        self._copies: list[tuple[int, int, int]] = []  # (src, dst, slots) owed by fork
        self.num_evictions = self.prefix_queries = self.prefix_hits = 0

    # ---- prefix cache -------------------------------------------------------------
    def _walk(self, tokens: list[int], salt: str | None, limit: int) -> list[int]:
        bs, parent, blocks = self.block_size, None, []
        for k in range(limit // bs):
            chunk = tuple(tokens[k * bs:(k + 1) * bs])
            key = block_key(parent, chunk, salt)
            block = self._by_key.get(key)
            if block is None:
                break
            meta = self._meta[block]
            if meta.tokens != chunk or meta.parent != parent:  # a hash collision, not a hit
                break
            blocks.append(block)
            parent = key
        return blocks

    def match_prefix(self, seq: Sequence) -> int:
        """Tokens of ``seq`` a claim would find cached now (read-only)."""
        if not self.prefix_caching or seq.num_computed_tokens:
            return 0
        return len(self._walk(seq.token_ids, seq.cache_salt, seq.num_tokens - 1)) * self.block_size

    def claim_prefix(self, seq: Sequence) -> int:
        """Take the cached blocks of ``seq``'s longest registered prefix into its table.
        At least one token is always left to compute (its logits are needed)."""
        if not self.prefix_caching or seq.num_computed_tokens or seq.seq_id in self._tables:
            return 0
        blocks = self._walk(seq.token_ids, seq.cache_salt, seq.num_tokens - 1)
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
                self._num_cached -= 1  # a claimed block is registered: cached -> used
            self._ref[b] += 1
        if blocks:
            self._tables[seq.seq_id] = list(blocks)
            self._num_tokens[seq.seq_id] = len(blocks) * self.block_size
            self._registered[seq.seq_id] = (len(blocks), self._meta[blocks[-1]].key)
        if not seq.num_preemptions:  # first admission: count for stats
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += len(blocks) * self.block_size
        return len(blocks) * self.block_size

    def _register_computed(self, seq: Sequence) -> None:
        """Register every full block whose KV is computed (``num_computed_tokens``)."""
        if not self.prefix_caching:
            return
        table = self._tables.get(seq.seq_id)
        if not table:
            return
        bs = self.block_size
        done, parent = self._registered.get(seq.seq_id, (0, None))
        full = min(seq.num_computed_tokens // bs, len(table))
        for k in range(done, full):
            block = table[k]
            chunk = tuple(seq.token_ids[k * bs:(k + 1) * bs])
            key = block_key(parent, chunk, seq.cache_salt)
            if block not in self._meta and key not in self._by_key:
                self._meta[block] = _Cached(key, parent, chunk)
                self._by_key[key] = block
            parent = key
        if full > done:
            self._registered[seq.seq_id] = (full, parent)

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        meta = self._meta.pop(block, None)
        if meta is not None:  # reusing a cached block evicts its registration
            del self._by_key[meta.key]
            self.num_evictions += 1
            self._num_cached -= 1
        self._ref[block] = 1
        return block

    # ---- allocation -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing (the free queue less its still-registered blocks)."""
        return len(self._free) - self._num_cached

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_ever_fit(self, seq: Sequence) -> bool:
        return cdiv(seq.max_len, self.block_size) <= self.num_blocks

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        have = len(self._tables.get(seq.seq_id, ()))
        return max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - have)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        return self._blocks_needed(seq, num_new_tokens + num_lookahead) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        self._register_computed(seq)
        need = self._blocks_needed(seq, num_new_tokens + num_lookahead)
        if need > len(self._free):
            return False
        table = self._tables.setdefault(seq.seq_id, [])
        table.extend(self._take_free_block() for _ in range(need))
        self._num_tokens[seq.seq_id] = max(self._num_tokens.get(seq.seq_id, 0),
                                           seq.num_computed_tokens + num_new_tokens)
        if num_lookahead:
            self._lookahead[seq.seq_id] = max(self._lookahead.get(seq.seq_id, 0), seq.num_computed_tokens
                                              + num_new_tokens + num_lookahead - self._num_tokens[seq.seq_id])
        return True

    def free(self, seq: Sequence) -> None:
        self._register_computed(seq)
        table = self._tables.pop(seq.seq_id, [])
        for b in reversed(table):  # tail blocks are the least likely to be shared: evict first
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                self._num_cached += b in self._meta
        self._num_tokens.pop(seq.seq_id, None)
        self._lookahead.pop(seq.seq_id, None)
        self._registered.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Give a new ``child`` the KV of ``parent``'s computed prefix that the two share
        (at most ``child.num_tokens - 1`` tokens: one is left to compute): full blocks by
        reference, a last partial block copied into a fresh block (copy-on-write, done by
        the runner before the next step: :meth:`take_copies`). Returns the tokens the child
        now has KV for; without a free block for the copy, only the full blocks."""
        table = self._tables.get(parent.seq_id, [])
        limit = min(parent.num_computed_tokens, child.num_tokens - 1, len(table) * self.block_size)
        n = 0
        a, b = parent.token_ids, child.token_ids
        while n < limit and a[n] == b[n]:
            n += 1
        if child.seq_id in self._tables or n == 0 or parent.cache_salt != child.cache_salt:
            return 0
        full, partial = divmod(n, self.block_size)
        shared = table[:full]
        for blk in shared:
            self._ref[blk] += 1
        if partial and self._free:
            dst = self._take_free_block()
            self._copies.append((table[full], dst, partial))
            shared = shared + [dst]
        else:
            partial = 0
        if not shared:
            return 0
        self._tables[child.seq_id] = list(shared)
        self._num_tokens[child.seq_id] = full * self.block_size + partial
        return full * self.block_size + partial

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The partial-block copies :meth:`fork` owes, for the runner to make before the next step."""
        out, self._copies = self._copies, []
        return out

    def block_table(self, seq: Sequence) -> list[int]:
        return self._tables.get(seq.seq_id, [])

    def stats(self) -> CacheStats:
        return CacheStats(self.num_blocks, self.num_free_blocks, self.block_size,
                          num_tokens_stored=sum(self._num_tokens.values()),
                          num_reserved_slots=sum(len(t) for t in self._tables.values()) * self.block_size,
                          num_evictions=self.num_evictions, num_cached_blocks=self._num_cached,
                          prefix_queries=self.prefix_queries, prefix_hits=self.prefix_hits)

    def block_states(self) -> bytes:
        meta = self._meta
        return bytes(BLOCK_USED if r else BLOCK_CACHED if b in meta else BLOCK_FREE
                     for b, r in enumerate(self._ref))

    def check_integrity(self) -> None:
        refs = [0] * self.num_blocks
        for sid, table in self._tables.items():
            assert len(table) == len(set(table)), f"seq {sid}: a block twice in one table"
            tokens, extra = self._num_tokens[sid], self._lookahead.get(sid, 0)
            assert cdiv(tokens, self.block_size) <= len(table) <= cdiv(tokens + extra, self.block_size), \
                f"seq {sid}: table size"
            for b in table:
                refs[b] += 1
        assert refs == self._ref, "reference counts disagree with the block tables"
        free = set(self._free)
        assert len(free) == len(self._free)
        assert free == {b for b in range(self.num_blocks) if refs[b] == 0}, "free set != unreferenced blocks"
        assert len(self._by_key) == len(self._meta), "hash index and registrations disagree"
        assert self._num_cached == sum(1 for b in self._free if b in self._meta), "cached count drifted"
        for block, meta in self._meta.items():
            assert self._by_key[meta.key] == block, "hash index points elsewhere"
            assert len(meta.tokens) == self.block_size


@hookimpl
def register_cache_managers(register):
    register("paged", PagedCacheManager, options=PagedOptions,
             description="PagedAttention block pool with hash-chained prefix caching")
