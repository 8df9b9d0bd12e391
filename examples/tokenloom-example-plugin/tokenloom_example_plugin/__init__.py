"""An example third-party plugin: the `shortest-first` scheduler, and a model family of
its own (parallel_model.py: attention and the MLP side by side in each block).

Shortest-job-first cuts mean latency when prompts vary a lot: among waiting requests it
admits the one with the fewest tokens left to prefill. To keep a long prompt from
starving, a request that has waited ``max_wait_steps`` steps goes first regardless.
It reuses the built-in continuous scheduler for everything else, and registers through
the same hook a built-in uses. Select it with ``[scheduler] name = "shortest-first"``.
"""

from __future__ import annotations

from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.sequence import SequenceStatus
from tokenloom.plugins.schedulers.continuous import ContinuousOptions, ContinuousScheduler


class ShortestFirstOptions(ContinuousOptions, kw_only=True, forbid_unknown_fields=True):
    max_wait_steps: int = 64


class ShortestFirstScheduler(ContinuousScheduler):
    def __init__(self, options: ShortestFirstOptions | None, cache, engine_config=None):
        options = options or ShortestFirstOptions()
        super().__init__(options, cache, engine_config)
        self.max_wait_steps = options.max_wait_steps
        self._waited: dict[int, int] = {}

    def schedule(self):
        for seq in self.waiting:
            self._waited[seq.seq_id] = self._waited.get(seq.seq_id, 0) + 1

        def key(seq):
            starving = self._waited.get(seq.seq_id, 0) >= self.max_wait_steps
            preempted = seq.status is SequenceStatus.PREEMPTED
            return (not (starving or preempted), seq.num_tokens - seq.num_computed_tokens)

        self.waiting = type(self.waiting)(sorted(self.waiting, key=key))
        batch = super().schedule()
        for seq in batch.seqs:
            self._waited.pop(seq.seq_id, None)
        return batch


@hookimpl
def register_models(register):
    from tokenloom_example_plugin.parallel_model import ParallelFamily

    register(ParallelFamily.name, ParallelFamily)


@hookimpl
def register_schedulers(register):
    register("shortest-first", ShortestFirstScheduler, options=ShortestFirstOptions,
             description="shortest prompt first, with a starvation bound (example plugin)")


__all__ = ["ShortestFirstScheduler", "ShortestFirstOptions"]
