"""`paged`: PagedAttention's block pool. A sequence holds exactly the blocks its tokens
fill (the last one partly), taken from a free pool one at a time, so memory is wasted
only in the last block of each sequence."""

from __future__ import annotations

from collections import deque

import msgspec

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import CacheStats
from tokenloom.core.sequence import Sequence


class PagedOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedCacheManager:
    def __init__(self, options: PagedOptions | None, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}  # token slots each sequence has claimed

    def can_ever_fit(self, seq: Sequence) -> bool:
        return cdiv(seq.max_len, self.block_size) <= self.num_blocks

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        have = len(self._tables.get(seq.seq_id, ()))
        return max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - have)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self._blocks_needed(seq, num_new_tokens)
        if need > len(self._free):
            return False
        table = self._tables.setdefault(seq.seq_id, [])
        table.extend(self._free.popleft() for _ in range(need))
        self._num_tokens[seq.seq_id] = max(self._num_tokens.get(seq.seq_id, 0),
                                           seq.num_computed_tokens + num_new_tokens)
        return True

    def free(self, seq: Sequence) -> None:
        self._free.extend(self._tables.pop(seq.seq_id, ()))
        self._num_tokens.pop(seq.seq_id, None)

    def block_table(self, seq: Sequence) -> list[int]:
        return self._tables.get(seq.seq_id, [])

    def stats(self) -> CacheStats:
        used = self.num_blocks - len(self._free)
        return CacheStats(self.num_blocks, len(self._free), self.block_size,
                          num_tokens_stored=sum(self._num_tokens.values()),
                          num_reserved_slots=used * self.block_size)

    def check_integrity(self) -> None:
        owned = [b for t in self._tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(self._free) == len(set(self._free)), "a block is free twice"
        assert not set(owned) & set(self._free), "a block is both owned and free"
        assert len(owned) + len(self._free) == self.num_blocks, "blocks leaked"
        for sid, table in self._tables.items():
            assert len(table) == cdiv(self._num_tokens[sid], self.block_size), f"seq {sid}: table size"


@hookimpl
def register_cache_managers(register):
    register("paged", PagedCacheManager, options=PagedOptions,
             description="PagedAttention block pool: blocks on demand, block tables")
