"""`continuous`: FCFS continuous batching (Orca / vLLM).

Each step: running sequences first, oldest first (decodes take one token, plus the draft
tokens their decoder proposed when the budget and the cache have room for them; a sequence
still prefilling takes the next chunk); then waiting sequences are admitted while the
token budget, the sequence cap and the KV cache allow. When a running sequence cannot
get a block, the newest running sequence is preempted by recompute: its KV is dropped
and it rejoins the front of the queue with its tokens, so its stream continues later
without a gap.
"""

from __future__ import annotations

import msgspec

from tokenloom.core.errors import ConfigError, RequestTooLong
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.sequence import Batch, Sequence, SequenceStatus
from tokenloom.plugins.schedulers.base import QueueScheduler


class ContinuousOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True


class ContinuousScheduler(QueueScheduler):
    def __init__(self, options: ContinuousOptions | None, cache, engine_config=None):
        options = options or ContinuousOptions()
        if options.max_num_seqs < 1 or options.max_num_batched_tokens < 1:
            raise ConfigError("scheduler.max_num_seqs and scheduler.max_num_batched_tokens must be >= 1")
        super().__init__(cache, options.max_num_seqs)
        self.token_budget = options.max_num_batched_tokens
        self.chunked = options.enable_chunked_prefill

    def add(self, seq: Sequence) -> None:
        if not self.chunked and seq.num_prompt_tokens > self.token_budget:
            raise RequestTooLong(
                f"prompt has {seq.num_prompt_tokens} tokens, more than scheduler.max_num_batched_tokens "
                f"({self.token_budget}) with chunked prefill off", param="prompt", value=seq.num_prompt_tokens)
        super().add(seq)

    def next_waiting(self) -> Sequence:
        """Which waiting sequence to admit next: FCFS here; subclasses reorder."""
        return self.waiting[0]

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.token_budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            drafts, parents = self.drafts_for(seq, n, budget)
            if drafts and not self.cache.allocate(seq, n, num_lookahead=len(drafts)):
                drafts = []  # no room to speculate: decode plainly, never preempt for drafts
            while not drafts and not self.cache.allocate(seq, n):
                victim = self.running[-1]
                self.preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.PREEMPTED:
                break
            self._add_to_batch(batch, seq, n, drafts, parents)
            budget -= n + len(drafts)
            i += 1
        if batch.preempted:  # memory is tight: admit nothing new this step
            return self.finalize(batch)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.next_waiting()
            self.claim_cached_prefix(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget:
                # Without chunking a prompt runs whole; a recomputed sequence longer than the
                # budget is the exception (it would never run otherwise).
                if not self.chunked and not (n > self.token_budget and batch.is_empty):
                    self.release_claim(seq)
                    break
                n = budget
            if not self.cache.allocate(seq, n):
                self.release_claim(seq)
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, n)
            budget -= n
        return self.finalize(batch)


@hookimpl
def register_schedulers(register):
    register("continuous", ContinuousScheduler, options=ContinuousOptions,
             description="FCFS continuous batching, chunked prefill, recompute preemption")
