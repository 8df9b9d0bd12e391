"""`contiguous`: reserve one contiguous run of blocks for a sequence's maximum length
(prompt + max_tokens) at admission, as servers did before PagedAttention. The baseline
that shows why paging matters: a request that stops early still holds its whole run."""

from __future__ import annotations

import msgspec

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.interfaces import CacheStats
from tokenloom.core.sequence import Sequence
from tokenloom.core.utils import cdiv


class ContiguousOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ContiguousCacheManager:
    prefix_caching = False

    def __init__(self, options: ContiguousOptions | None, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._used = bytearray(num_blocks)  # 1 where a block is reserved
        self.num_free_blocks = num_blocks
        self._runs: dict[int, tuple[int, int]] = {}  # seq_id -> (first block, count)
        self._num_tokens: dict[int, int] = {}

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks  # reserved; nothing is ever cached

    def _reserve_len(self, seq: Sequence) -> int:
        return cdiv(seq.max_len, self.block_size)

    def can_ever_fit(self, seq: Sequence) -> bool:
        return self._reserve_len(seq) <= self.num_blocks

    def _find_run(self, count: int) -> int | None:
        """First fit: the lowest start of ``count`` free blocks in a row, or None."""
        start = run = 0
        for i, used in enumerate(self._used):
            if used:
                run, start = 0, i + 1
            else:
                run += 1
                if run == count:
                    return start
        return None

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        if seq.seq_id in self._runs:
            return seq.num_computed_tokens + num_new_tokens + num_lookahead <= self._runs[seq.seq_id][1] * self.block_size
        return self._find_run(self._reserve_len(seq)) is not None

    def allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead: int = 0) -> bool:
        if seq.seq_id not in self._runs:
            count = self._reserve_len(seq)
            start = self._find_run(count)
            if start is None:
                return False
            self._used[start:start + count] = b"\x01" * count
            self._runs[seq.seq_id] = (start, count)
            self.num_free_blocks -= count
        start, count = self._runs[seq.seq_id]
        total = seq.num_computed_tokens + num_new_tokens
        if total + num_lookahead > count * self.block_size:
            return False
        self._num_tokens[seq.seq_id] = max(self._num_tokens.get(seq.seq_id, 0), total)
        return True

    # A reservation is private to its sequence: nothing can be shared, so no prefix cache.
    def match_prefix(self, seq: Sequence) -> int:
        return 0

    def claim_prefix(self, seq: Sequence) -> int:
        return 0

    def fork(self, parent: Sequence, child: Sequence) -> int:
        return 0

    def free(self, seq: Sequence) -> None:
        run = self._runs.pop(seq.seq_id, None)
        if run is not None:
            start, count = run
            self._used[start:start + count] = bytes(count)
            self.num_free_blocks += count
        self._num_tokens.pop(seq.seq_id, None)

    def take_copies(self) -> list[tuple[int, int, int]]:
        return []

    def block_table(self, seq: Sequence) -> list[int]:
        run = self._runs.get(seq.seq_id)
        return list(range(run[0], run[0] + run[1])) if run else []

    def stats(self) -> CacheStats:
        used = sum(self._used)
        return CacheStats(self.num_blocks, self.num_blocks - used, self.block_size,  # no cached blocks
                          num_tokens_stored=sum(self._num_tokens.values()),
                          num_reserved_slots=used * self.block_size)

    def block_states(self) -> bytes:
        return bytes(self._used)  # 1 = BLOCK_USED; nothing is ever cached

    def check_integrity(self) -> None:
        marks = bytearray(self.num_blocks)
        for start, count in self._runs.values():
            assert 0 <= start and start + count <= self.num_blocks, "run out of range"
            for b in range(start, start + count):
                assert not marks[b], f"block {b} reserved twice"
                marks[b] = 1
        assert marks == self._used, "reservation map disagrees with the runs"
        assert self.num_free_blocks == self.num_blocks - sum(marks), "free count drifted"
        for sid, n in self._num_tokens.items():
            assert n <= self._runs[sid][1] * self.block_size, f"seq {sid} overflows its run"


@hookimpl
def register_cache_managers(register):
    register("contiguous", ContiguousCacheManager, options=ContiguousOptions,
             description="reserve max length per sequence (the pre-paging baseline)")
