"""`static`: traditional static batching, the baseline continuous batching is compared
against. A batch of up to ``max_num_seqs`` requests is admitted only when the previous
one has completely finished; each reserves KV for its full length (prompt + max_tokens)
up front, prefills its whole prompt in the first step, then decodes in lock-step. A
finished sequence's slot stays empty until the whole batch is done."""

from __future__ import annotations

import msgspec

from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.sequence import Batch, SequenceStatus
from tokenloom.plugins.schedulers.base import QueueScheduler


class StaticOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_num_seqs: int = 32


class StaticScheduler(QueueScheduler):
    def __init__(self, options: StaticOptions | None, cache, engine_config=None):
        options = options or StaticOptions()
        if options.max_num_seqs < 1:
            raise ConfigError("scheduler.max_num_seqs must be >= 1")
        super().__init__(cache, options.max_num_seqs)

    def schedule(self) -> Batch:
        batch = Batch()
        if not self.running:
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                self.claim_cached_prefix(seq)
                if not self.cache.allocate(seq, seq.max_len - seq.num_computed_tokens):
                    self.release_claim(seq)
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
        for seq in self.running:
            n = seq.num_tokens - seq.num_computed_tokens
            drafts, parents = self.drafts_for(seq, n, seq.max_len)
            # A chain fits the max_len reservation; a tree's nodes each take a slot and may
            # not: then it needs more blocks, or it goes without drafts this step.
            if drafts and not self.cache.allocate(seq, n, num_lookahead=len(drafts)):
                drafts, parents = [], None
            self._add_to_batch(batch, seq, n, drafts, parents)
        return self.finalize(batch)


@hookimpl
def register_schedulers(register):
    register("static", StaticScheduler, options=StaticOptions,
             description="static batching: a new batch only when the last one is done")
