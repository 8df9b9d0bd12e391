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
    # 0 = auto: chosen at start-up from the KV pool and the machine (planner/serving.py)
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, key)
            if value < 0:
                raise ConfigError(f"scheduler.{key} must be >= 1, or 0 for auto (chosen from the KV pool "
                                  f"and the machine); got {value}")


class ContinuousScheduler(QueueScheduler):
    def __init__(self, options: ContinuousOptions | None, cache, engine_config=None):
        options = options or ContinuousOptions()
        if options.max_num_seqs == 0 or options.max_num_batched_tokens == 0:
            # built outside the engine (which resolves them first, knowing max_model_len and
            # the device): the same rule, from this cache's pool and what engine_config says
            from tokenloom.planner.serving import resolve_auto

            options, _ = resolve_auto(options, cache.num_blocks, cache.block_size, **_machine(engine_config))
        if options.max_num_seqs < 1 or options.max_num_batched_tokens < 1:
            raise ConfigError("scheduler.max_num_seqs and scheduler.max_num_batched_tokens must be >= 1 (0: auto)")
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

    def pick_victim(self, batch: Batch) -> Sequence:
        """Which running sequence to preempt when a block runs out: the newest. It is never
        one already in ``batch`` (running sequences are scheduled oldest first)."""
        return self.running[-1]

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.token_budget
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            used = self.run_running(seq, min(seq.num_tokens - seq.num_computed_tokens, budget), budget, batch)
            if used is None:
                break
            budget -= used
            i += 1
        if batch.preempted:  # memory is tight: admit nothing new this step
            return self.finalize(batch)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            used = self.admit(self.next_waiting(), budget, batch)
            if used is None:
                break
            budget -= used
        return self.finalize(batch)

    def run_running(self, seq: Sequence, n: int, budget: int, batch: Batch) -> int | None:
        """Put ``n`` tokens of running ``seq`` in ``batch``, plus the draft tokens its decoder
        proposed when ``budget`` and the cache have room for them; preempt others (by
        :meth:`pick_victim`) when its blocks cannot be had. Returns the tokens it took, or
        None when ``seq`` itself was preempted."""
        drafts, parents = self.drafts_for(seq, n, budget)
        if drafts and not self.cache.allocate(seq, n, num_lookahead=len(drafts)):
            drafts = []  # no room to speculate: decode plainly, never preempt for drafts
        while not drafts and not self.cache.allocate(seq, n):
            victim = self.pick_victim(batch)
            self.preempt(victim, batch)
            if victim is seq:
                return None
        self._add_to_batch(batch, seq, n, drafts, parents)
        return n + len(drafts)

    def admit(self, seq: Sequence, budget: int, batch: Batch) -> int | None:
        """Move waiting ``seq`` to running with up to ``budget`` tokens of its prefill (its
        cached prefix claimed first). Returns the tokens it took, or None (nothing changed)
        when it does not fit: the cache is full, or its prompt exceeds the budget with
        chunked prefill off."""
        self.claim_cached_prefix(seq)
        n = seq.num_tokens - seq.num_computed_tokens
        if n > budget:
            # Without chunking a prompt runs whole; a recomputed sequence longer than the
            # budget is the exception (it would never run otherwise).
            if not self.chunked and not (n > self.token_budget and batch.is_empty):
                self.release_claim(seq)
                return None
            n = budget
        if not self.cache.allocate(seq, n):
            self.release_claim(seq)
            return None
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._add_to_batch(batch, seq, n)
        return n

    def stats(self) -> dict[str, float]:
        """The limits in force (the auto ones as chosen at start-up): engine.stats() and
        /health show them as ``scheduler_max_num_seqs``, ``scheduler_max_num_batched_tokens``."""
        return {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.token_budget}


def _machine(engine_config) -> dict:
    """What a scheduler built without the engine knows of the machine: the configured device
    (``auto``: CUDA when there is one) and torch's threads; max_model_len when it is set."""
    import torch

    e = getattr(engine_config, "engine", None)
    device = e.device if e is not None else "auto"
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else torch.device(device).type
    return {"max_model_len": (e.max_model_len or None) if e is not None else None, "device_type": kind,
            "cores": torch.get_num_threads()}


@hookimpl
def register_schedulers(register):
    register("continuous", ContinuousScheduler, options=ContinuousOptions,
             description="FCFS continuous batching, chunked prefill, recompute preemption")
