"""`slo`: continuous batching that plans each step against per-request latency targets.

A request carries targets (``SamplingParams.ttft_ms``, ``tpot_ms``) or a class
(``slo_class``) whose defaults come from ``[scheduler.classes]``; a request with neither is
*best-effort*. The scheduler learns how long steps take (a linear model of prefill tokens,
decodes, KV tokens read and whether the step prefills at all, refitted after every step:
plugins/schedulers/cost_model.py) and builds each step in this order:

1. **Decodes** of running sequences, oldest first (with their draft tokens, as in
   `continuous`). They are never held back: skipping one only adds to its TPOT.
2. **Targeted prefill work**, most urgent first: a stream that was preempted after its
   first token (its TPOT is stalling), then requests by TTFT deadline (arrival + ``ttft_ms``),
   running chunks and waiting admissions alike. This work takes the token budget before any
   best-effort prefill, so an interactive prompt gets in ahead of a long batch prompt.
3. **Best-effort prefill** (running chunks first, then admissions in queue order) fills
   the slack: each chunk is shrunk so the predicted step time stays within the time left
   before the TTFT deadline of any request whose first token this step produces, and within
   the TPOT room of every sequence decoding in it. TPOT is a mean, so the room is what keeps
   the mean within target once this step's token lands: ``k·tpot - (now - t1)`` for k tokens
   so far, the first at t1 (the scheduler notes t1 in ``observe``). Steps faster than the
   target bank room that an occasional larger chunk spends, which pays the fixed cost of a
   prefill step once instead of in every step. And for ``arrival_guard_s`` after a request
   with a TTFT target arrived, best-effort steps stay within half the smallest such target,
   so that one arriving while a step runs does not wait behind a long chunk. All of this
   plans against ``target_margin`` (0.9) of each target. Best-effort
   prefill held back entirely for ``max_best_effort_skips`` steps in a row gets at least
   ``min_best_effort_tokens`` in the next one: it cannot starve, and a cost model that
   predicts too much cannot stall it.

With no targeted request around, the caps are infinite and every step is `continuous`'s,
except for the order (decodes before prefill chunks). While the cost model has seen fewer
than 8 steps it predicts 0 s and nothing is capped. Preemption is by recompute as in
`continuous`; the victim is the newest best-effort sequence not yet in the step, else the
newest one not yet in the step.

Attainment: at each request's end (finish reasons stop, length, timeout; aborted and
failed requests are not counted) the engine's own measured TTFT and TPOT are compared with
the request's targets, per class (``slo_class``, else ``default``): finished, TTFT met,
TPOT met, both met. A target that is not set is met; a timed-out request meets neither;
a request with one output token has no TPOT to miss. ``stats()`` returns them as
``slo_<class>_<outcome>``, with the cost model's coefficients (``cost_*``).
"""

from __future__ import annotations

import math
import time

import msgspec

from tokenloom.core.errors import ConfigError
from tokenloom.core.hookspecs import hookimpl
from tokenloom.core.metrics import SLO_OUTCOMES, slo_stat_key
from tokenloom.core.outputs import Finished
from tokenloom.core.sampling_params import MAX_SLO_TARGET_MS, SLO_CLASS_RE
from tokenloom.core.sequence import Batch, Sequence, SequenceStatus
from tokenloom.plugins.schedulers.continuous import ContinuousOptions, ContinuousScheduler
from tokenloom.plugins.schedulers.cost_model import StepCostModel, StepWork

DEFAULT_CLASS = "default"  # the class of a request that names none
OTHER_CLASS = "other"  # unconfigured class names past MAX_TRACKED_CLASSES are counted here
MAX_TRACKED_CLASSES = 16  # distinct unconfigured class names counted separately (names are free)
COUNTED_REASONS = ("stop", "length", "timeout")


class SloClass(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A class's default targets, in milliseconds (None: no target)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


def _default_classes() -> dict[str, SloClass]:
    # A chat-like default for a machine where a decode step takes a few to tens of ms (the
    # embedded model on 2 idle cores): reachable when a request is scheduled at once, not
    # behind a long prompt's chunks. Set the classes your deployment promises.
    return {"interactive": SloClass(ttft_ms=500.0, tpot_ms=100.0)}


class SloOptions(ContinuousOptions, kw_only=True, forbid_unknown_fields=True):
    # default targets per class; replaces the built-in table (interactive: 500 / 100 ms)
    classes: dict[str, SloClass] = msgspec.field(default_factory=_default_classes)
    # best-effort prefill held back entirely for max_best_effort_skips steps in a row gets at
    # least min_best_effort_tokens in the next one, whatever the caps say: it cannot starve
    max_best_effort_skips: int = 8
    min_best_effort_tokens: int = 32
    # for this long after a request with a TTFT target arrives, best-effort prefill keeps each
    # step within half the smallest such target, so one arriving mid-step can still start in
    # time (0: off)
    arrival_guard_s: float = 30.0
    cost_decay: float = 0.98  # weight of a step observed one step earlier in the cost fit
    # plan against this share of each target: predictions err, and a token's time includes the
    # work between steps; at 1.0 the streams land on their TPOT target and half of them miss
    target_margin: float = 0.9


class SloScheduler(ContinuousScheduler):
    def __init__(self, options: SloOptions | None, cache, engine_config=None):
        options = options or SloOptions()
        _check(options)
        super().__init__(options, cache, engine_config)
        self.classes = dict(options.classes)
        self.min_best_effort_tokens = options.min_best_effort_tokens
        self.cost = StepCostModel(decay=options.cost_decay)
        self.arrival_guard_s = options.arrival_guard_s
        self.margin = options.target_margin
        self._guard_cap, self._guard_until = math.inf, -math.inf  # seconds; clock time
        self.counts: dict[str, dict[str, int]] = {}
        self.first_token_time: dict[int, float] = {}  # seq_id -> when its first token was sampled
        self.max_best_effort_skips = options.max_best_effort_skips
        self._skips = 0  # steps in a row best-effort prefill was held back entirely
        self.clock = time.monotonic  # the clock deadlines are read on (Sequence.arrival_time's)

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        ttft = self.targets(seq)[0]
        if ttft is not None and self.arrival_guard_s > 0:
            now = self.clock()
            if now > self._guard_until:
                self._guard_cap = math.inf
            self._guard_cap = min(self._guard_cap, ttft / 2e3)
            self._guard_until = now + self.arrival_guard_s

    # ---- targets ------------------------------------------------------------------
    def targets(self, seq: Sequence) -> tuple[float | None, float | None]:
        """(TTFT, TPOT) targets in ms: the request's own, else its class's defaults."""
        p = seq.params
        cls = self.classes.get(p.slo_class or DEFAULT_CLASS)
        ttft = p.ttft_ms if p.ttft_ms is not None else (cls.ttft_ms if cls else None)
        tpot = p.tpot_ms if p.tpot_ms is not None else (cls.tpot_ms if cls else None)
        return ttft, tpot

    def urgency(self, seq: Sequence) -> tuple[int, float] | None:
        """Sort key among targeted prefill work, None for best-effort work: a stalled stream
        (preempted after its first token, with a TPOT target) first, then by TTFT deadline."""
        ttft, tpot = self.targets(seq)
        if seq.num_output_tokens > 0:
            return (0, seq.arrival_time) if tpot is not None else None
        return (1, seq.arrival_time + ttft / 1e3) if ttft is not None else None

    # ---- the step -------------------------------------------------------------------
    def schedule(self) -> Batch:
        now = self.clock()
        plan = _Plan(Batch(), self.token_budget)
        for seq in [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]:
            if plan.budget <= 0:
                break
            if seq.status is SequenceStatus.PREEMPTED:  # a victim of an older sequence's growth
                continue
            if self._run(plan, seq, 1, now) is None:
                break
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        candidates = prefilling + list(self.waiting)
        for seq in sorted((s for s in candidates if self.urgency(s) is not None), key=self.urgency):
            if plan.budget <= 0:
                break
            if seq.status is SequenceStatus.RUNNING:
                self._run(plan, seq, min(seq.num_tokens - seq.num_computed_tokens, plan.budget), now)
            elif seq not in prefilling and plan.room(self):
                self._admit(plan, seq, plan.budget, now)
        if now <= self._guard_until:  # targeted requests are arriving: leave room for the next
            plan.cap = min(plan.cap, self._guard_cap)
        # held back too many steps in a row: this step runs some best-effort prefill regardless
        floor = self.min_best_effort_tokens if self._skips >= self.max_best_effort_skips else 0
        best_effort, ran = [s for s in candidates if self.urgency(s) is None], 0
        for seq in best_effort:
            if plan.budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING and (seq in prefilling or not plan.room(self)):
                continue  # preempted during this step, or no room to admit it
            n = min(seq.num_tokens - seq.num_computed_tokens, plan.budget)
            n = max(self._tokens_within(plan.work, seq.num_computed_tokens, n, plan.cap), min(floor, n))
            if n <= 0:
                break
            if seq.status is SequenceStatus.RUNNING:
                used = self._run(plan, seq, n, now)
            else:
                used = self._admit(plan, seq, n, now)
            floor = max(0, floor - (used or 0))
            ran += used or 0
        self._skips = self._skips + 1 if best_effort and not ran else 0
        return self.finalize(plan.batch)

    def _run(self, plan: _Plan, seq: Sequence, n: int, now: float) -> int | None:
        computed = seq.num_computed_tokens
        used = self.run_running(seq, n, plan.budget, plan.batch)
        if plan.batch.preempted:
            plan.admitting = False  # memory is tight: admit nothing new this step
        if used is not None:
            self._note(plan, seq, computed, used, now)
        return used

    def _admit(self, plan: _Plan, seq: Sequence, n: int, now: float) -> int | None:
        used = self.admit(seq, n, plan.batch)
        if used is None:
            plan.admitting = False  # the cache is full: later ones would not fit either
        else:
            self._note(plan, seq, seq.num_computed_tokens, used, now)
        return used

    def _note(self, plan: _Plan, seq: Sequence, computed: int, used: int, now: float) -> None:
        """Account for ``used`` tokens of ``seq`` in the step: their work, and the time cap
        the sequence's targets set when the step ends with a token for it."""
        plan.work.add(computed, used)
        plan.budget -= used
        if computed + plan.batch.num_scheduled_tokens[-1] < seq.num_tokens:
            return  # a partial prefill chunk: no token this step
        ttft, tpot = self.targets(seq)
        if seq.num_output_tokens == 0 and ttft is not None:
            left = seq.arrival_time + self.margin * ttft / 1e3 - now
            if left > 0:  # a deadline already missed caps nothing: it cannot be met any more
                plan.cap = min(plan.cap, left)
        elif seq.num_output_tokens > 0 and tpot is not None:
            plan.cap = min(plan.cap, self._tpot_room(seq, self.margin * tpot / 1e3, now))

    def _tpot_room(self, seq: Sequence, tpot: float, now: float) -> float:
        """Seconds the step may take so that ``seq``'s mean time per output token stays within
        ``tpot``: with k tokens so far, the first sampled at t1, the next one comes at the end
        of this step, and ``(end - t1) / k <= tpot``. Steps faster than the target leave room
        that one larger step may spend; a stream behind its target leaves none."""
        t1 = self.first_token_time.get(seq.seq_id)
        if t1 is None:  # its first token came before this scheduler saw a step
            return tpot
        return seq.num_output_tokens * tpot - (now - t1)

    def _tokens_within(self, work: StepWork, computed: int, n: int, cap: float) -> int:
        """The most of ``n`` prefill tokens (after ``computed``) the step can take with its
        predicted time within ``cap`` seconds (binary search: the cost only grows)."""
        if math.isinf(cap) or self.cost.predict(work.plus(computed, n)) <= cap:
            return n
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost.predict(work.plus(computed, mid)) <= cap:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def pick_victim(self, batch: Batch) -> Sequence:
        """The newest best-effort running sequence not yet in ``batch``, else the newest one
        not yet in it (the sequence asking for blocks is always a candidate)."""
        free = [s for s in self.running if s not in batch.seqs]
        best_effort = [s for s in free if self.targets(s) == (None, None)]
        return (best_effort or free)[-1]

    # ---- learning and counting ------------------------------------------------------
    def observe(self, batch: Batch, step_time_s: float) -> None:
        self.cost.observe(StepWork.of_batch(batch), step_time_s)
        now = self.clock()
        for seq, n in zip(batch.seqs, batch.num_scheduled_tokens, strict=True):
            if seq.num_output_tokens == 0 and seq.num_computed_tokens + n == seq.num_tokens:
                self.first_token_time[seq.seq_id] = now  # this step sampled its first token

    def on_finished(self, seq: Sequence, output: Finished) -> None:
        self.first_token_time.pop(seq.seq_id, None)
        if output.finish_reason not in COUNTED_REASONS:
            return
        ttft, tpot = self.targets(seq)
        m = output.metrics
        timed_out = output.finish_reason == "timeout"
        ttft_met = not timed_out and (ttft is None or (m.ttft_ms is not None and m.ttft_ms <= ttft))
        tpot_met = not timed_out and (tpot is None or m.tpot_ms is None or m.tpot_ms <= tpot)
        counts = self._counts_for(seq.params.slo_class or DEFAULT_CLASS)
        counts["finished"] += 1
        counts["ttft_met"] += ttft_met
        counts["tpot_met"] += tpot_met
        counts["both_met"] += ttft_met and tpot_met

    def _counts_for(self, name: str) -> dict[str, int]:
        if name not in self.counts and name not in self.classes and name != DEFAULT_CLASS:
            unconfigured = sum(c not in self.classes and c != DEFAULT_CLASS for c in self.counts)
            if unconfigured >= MAX_TRACKED_CLASSES:
                name = OTHER_CLASS
        return self.counts.setdefault(name, dict.fromkeys(SLO_OUTCOMES, 0))

    def stats(self) -> dict[str, float]:
        out = super().stats()  # the limits in force
        out.update({slo_stat_key(cls, k): v for cls, c in self.counts.items() for k, v in c.items()})
        a, e, b, c, d = self.cost.coef if self.cost.ready else (0.0,) * 5
        out.update(cost_base_ms=a * 1e3, cost_prefill_step_ms=e * 1e3, cost_prefill_token_us=b * 1e6,
                   cost_decode_us=c * 1e6, cost_kv_token_ns=d * 1e9)
        return out


class _Plan:
    """One step under construction: the batch, token budget left, the predicted work, the
    time cap targets set, whether admissions are still open."""

    __slots__ = ("batch", "budget", "work", "cap", "admitting")

    def __init__(self, batch: Batch, budget: int):
        self.batch, self.budget, self.work = batch, budget, StepWork()
        self.cap, self.admitting = math.inf, True  # cap: seconds the predicted step may take

    def room(self, sched: SloScheduler) -> bool:
        """May a waiting sequence be admitted now?"""
        return self.admitting and len(sched.running) < sched.max_num_seqs


def _check(options: SloOptions) -> None:
    if options.min_best_effort_tokens < 0 or options.max_best_effort_skips < 0:
        raise ConfigError("scheduler.min_best_effort_tokens and scheduler.max_best_effort_skips must be >= 0")
    if not 0.0 < options.target_margin <= 1.0:
        raise ConfigError(f"scheduler.target_margin must be in (0, 1], got {options.target_margin}")
    if not (math.isfinite(options.arrival_guard_s) and options.arrival_guard_s >= 0):
        raise ConfigError(f"scheduler.arrival_guard_s must be >= 0, got {options.arrival_guard_s}")
    if not 0.0 < options.cost_decay <= 1.0:
        raise ConfigError(f"scheduler.cost_decay must be in (0, 1], got {options.cost_decay}")
    for name, cls in options.classes.items():
        if not SLO_CLASS_RE.fullmatch(name):
            raise ConfigError(f"scheduler.classes: class name {name!r} must be 1 to 64 letters, digits, '_', '-' or '.'")
        for key in ("ttft_ms", "tpot_ms"):
            value = getattr(cls, key)
            if value is not None and not (math.isfinite(value) and 0.0 < value <= MAX_SLO_TARGET_MS):
                raise ConfigError(f"scheduler.classes.{name}.{key} must be in (0, {MAX_SLO_TARGET_MS:g}] ms, got {value}")


@hookimpl
def register_schedulers(register):
    register("slo", SloScheduler, options=SloOptions,
             description="continuous batching planned against per-request TTFT/TPOT targets (cost model)")
