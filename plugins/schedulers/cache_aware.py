"""`cache-aware`: continuous batching that admits the waiting request with the longest
cached prefix first (SGLang's longest-prefix-match policy), so requests sharing a
prefix run while it is still cached instead of evicting each other's KV.

Bounded waiting: a request passed over ``max_skips`` times goes next regardless, oldest
first, so no request starves; a preempted request (it holds progress) always goes first.
"""

from __future__ import annotations

from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.sequence import Sequence, SequenceStatus
from tokenloom.plugins.schedulers.continuous import ContinuousOptions, ContinuousScheduler


class CacheAwareOptions(ContinuousOptions, kw_only=True, forbid_unknown_fields=True):
    max_skips: int = 32  # admissions a request may be passed over before it goes first
    lookahead: int = 128  # waiting requests considered per admission


class CacheAwareScheduler(ContinuousScheduler):
    def __init__(self, options: CacheAwareOptions | None, cache, engine_config=None):
        options = options or CacheAwareOptions()
        if not cache.prefix_caching:
            raise ConfigError("scheduler 'cache-aware' needs a prefix cache: set "
                              "cache_manager.enable_prefix_caching = true")
        if options.max_skips < 0 or options.lookahead < 1:
            raise ConfigError("scheduler.max_skips must be >= 0 and scheduler.lookahead >= 1")
        super().__init__(options, cache, engine_config)
        self.max_skips, self.lookahead = options.max_skips, options.lookahead
        self._skips: dict[int, int] = {}

    def next_waiting(self) -> Sequence:
        candidates = [s for _, s in zip(range(self.lookahead), self.waiting, strict=False)]
        for seq in candidates:  # preempted first, then anyone passed over too often (FCFS)
            if seq.status is SequenceStatus.PREEMPTED or self._skips.get(seq.seq_id, 0) >= self.max_skips:
                return self._pick(seq, candidates)
        best = max(candidates, key=lambda s: (self.cache.match_prefix(s), -s.arrival_time))
        return self._pick(best, candidates)

    def _pick(self, chosen: Sequence, candidates: list[Sequence]) -> Sequence:
        for seq in candidates:
            if seq is not chosen and seq.arrival_time < chosen.arrival_time:
                self._skips[seq.seq_id] = self._skips.get(seq.seq_id, 0) + 1
        self._skips.pop(chosen.seq_id, None)
        return chosen

    def abort(self, request_id: str):
        seq = super().abort(request_id)
        if seq is not None:
            self._skips.pop(seq.seq_id, None)
        return seq


@hookimpl
def register_schedulers(register):
    register("cache-aware", CacheAwareScheduler, options=CacheAwareOptions,
             requires={"cache_manager": ["paged", "radix"]},
             description="longest cached prefix first (SGLang), with bounded waiting")
