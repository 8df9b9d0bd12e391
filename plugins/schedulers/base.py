"""Queue bookkeeping shared by the built-in schedulers."""

from __future__ import annotations

from collections import deque

from tokenloom.core.errors import RequestTooLong
from tokenloom.core.outputs import Finished
from tokenloom.core.sequence import Batch, Sequence, SequenceStatus, draft_depths


class QueueScheduler:
    """A waiting deque and a running list (oldest first), plus finish/abort/preempt, and
    no-op ``observe``, ``on_finished`` and ``stats`` (the Scheduler protocol requires them)."""

    def __init__(self, cache, max_num_seqs: int):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if not self.cache.can_ever_fit(seq):
            raise RequestTooLong(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) needs "
                f"more KV blocks than the cache has ({self.cache.num_blocks} x {self.cache.block_size} tokens)",
                param="max_tokens", value=seq.params.max_tokens,
            )
        seq.status = SequenceStatus.WAITING
        if seq.num_computed_tokens:  # a fork of an n > 1 request: it holds its KV already, and
            self.waiting.appendleft(seq)  # arrived with its first sample: first in line
        else:
            self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.cache.free(seq)
                    seq.status = SequenceStatus.FINISHED_ABORTED
                    return seq
        return None

    def preempt(self, seq: Sequence, batch: Batch) -> None:
        """Recompute preemption: drop the KV, keep the tokens, go back to the queue's front."""
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids, seq.draft_parents = [], None
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def claim_cached_prefix(self, seq: Sequence) -> None:
        """Before a sequence's first chunk: start it past whatever prefix is cached."""
        if seq.num_computed_tokens == 0:
            cached = self.cache.claim_prefix(seq)
            seq.num_computed_tokens = cached
            if not seq.num_preemptions:
                seq.num_cached_tokens = cached

    def release_claim(self, seq: Sequence) -> None:
        """Admission failed after a claim: give the cached blocks back."""
        self.cache.free(seq)
        seq.num_computed_tokens = 0

    def finalize(self, batch: Batch) -> Batch:
        batch.copies = self.cache.take_copies()
        return batch

    @staticmethod
    def drafts_for(seq: Sequence, n: int, budget: int) -> tuple[list[int], list[int] | None]:
        """The proposed tokens (and tree parents, or None for a chain) ``seq`` verifies this
        step if it runs ``n`` tokens: only when those reach its end, at most ``budget - n``
        of them, and none so deep that accepting its whole branch plus the bonus token would
        pass ``max_tokens`` (nodes come depth by depth, so both cuts keep a prefix)."""
        drafts = seq.draft_token_ids
        if not drafts or seq.num_computed_tokens + n != seq.num_tokens:
            return [], None
        room = seq.max_len - seq.num_tokens - 1  # the deepest draft that may be accepted
        parents = seq.draft_parents
        if parents is None:
            k = min(len(drafts), budget - n, room)
        else:
            depth = draft_depths(parents)
            k = min(sum(d <= room for d in depth), budget - n)
        if k <= 0:
            return [], None
        return drafts[:k], (parents[:k] if parents is not None else None)

    def _add_to_batch(self, batch: Batch, seq: Sequence, n: int, drafts: list[int] | None = None,
                      parents: list[int] | None = None) -> None:
        batch.seqs.append(seq)
        batch.num_scheduled_tokens.append(n)
        batch.draft_tokens.append(drafts or [])
        batch.draft_parents.append(parents if drafts else None)
        batch.block_tables.append(self.cache.block_table(seq))

    def observe(self, batch: Batch, step_time_s: float) -> None:
        """The step that ran ``batch`` took ``step_time_s``: nothing to learn by default."""

    def on_finished(self, seq: Sequence, output: Finished) -> None:
        """A request ended: nothing to count by default."""

    def stats(self) -> dict[str, float]:
        return {}

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
