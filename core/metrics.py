"""Per-request timing (TTFT, TPOT, inter-token latency) and per-step engine stats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenloom.core.outputs import RequestMetrics


@dataclass(slots=True)
class RequestTimer:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)

    def on_scheduled(self, now: float) -> None:
        if self.first_scheduled is None:
            self.first_scheduled = now

    def on_tokens(self, now: float, n: int) -> None:
        self.token_times.extend([now] * n)

    def finish(self, num_preemptions: int = 0, num_drafted: int = 0, num_accepted: int = 0,
               drafted_by: dict[str, int] | None = None) -> RequestMetrics:
        now = time.monotonic()
        t = self.token_times
        ttft = (t[0] - self.arrival) * 1e3 if t else None
        tpot = (t[-1] - t[0]) * 1e3 / (len(t) - 1) if len(t) > 1 else None
        itl = [(b - a) * 1e3 for a, b in zip(t, t[1:], strict=False)]
        queue = (self.first_scheduled - self.arrival) * 1e3 if self.first_scheduled is not None else None
        return RequestMetrics(ttft_ms=ttft, tpot_ms=tpot, e2e_ms=(now - self.arrival) * 1e3,
                              queue_ms=queue, itl_ms=itl, num_preemptions=num_preemptions,
                              num_draft_tokens=num_drafted, num_accepted_tokens=num_accepted,
                              drafted_by=dict(drafted_by or {}))


@dataclass(slots=True, kw_only=True)
class StepStats:
    """One step, for the ``step_finished`` hook (built by keyword only: fields may be added)."""

    step: int
    step_time_ms: float
    num_running: int
    num_waiting: int
    num_batched_tokens: int
    num_prefill_tokens: int
    num_decode_seqs: int
    num_generated_tokens: int
    num_preempted: int  # this step
    total_preemptions: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_hit_rate: float


@dataclass(slots=True)
class EngineCounters:
    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished_requests: int = 0
    preemptions: int = 0
    peak_kv_usage: float = 0.0
    peak_running: int = 0
    busy_time_s: float = 0.0


def engine_stats(cs, scheduler, c: EngineCounters, decoder_stats: dict | None = None,
                 scheduler_stats: dict | None = None) -> dict:
    """What /health and /metrics show: queues, KV blocks (every block is used by live
    sequences, cached as reclaimable prefix KV, or free), prefix hits, counters, the
    decoders' own counters under ``decoder_*`` (speculation: drafted, accepted, ...) and the
    scheduler's under ``scheduler_*`` (``slo``: attainment per class)."""
    return {**{f"decoder_{k}": v for k, v in (decoder_stats or {}).items()},
        **{f"scheduler_{k}": v for k, v in (scheduler_stats or {}).items()},
        "running": scheduler.num_running, "waiting": scheduler.num_waiting,
        "kv_usage": cs.usage, "kv_blocks_used": cs.num_used_blocks, "kv_blocks_cached": cs.num_cached_blocks,
        "kv_blocks_free": cs.num_free_blocks, "kv_blocks_total": cs.num_blocks,
        "kv_waste": cs.waste, "prefix_hit_rate": cs.hit_rate, "prefix_cached_blocks": cs.num_cached_blocks,
        "prefix_queries": cs.prefix_queries, "prefix_hits": cs.prefix_hits,
        "prefix_evictions": cs.num_evictions, "preemptions": c.preemptions,
        "steps": c.steps, "generated_tokens": c.generated_tokens, "prompt_tokens": c.prompt_tokens,
        "finished_requests": c.finished_requests, "peak_kv_usage": c.peak_kv_usage,
        "peak_running": c.peak_running,
    }


# SLO attainment counters (the `slo` scheduler): one per (class, outcome), named
# ``slo_<class>_<outcome>`` in Scheduler.stats(), so engine.stats() shows them as
# ``scheduler_slo_<class>_<outcome>`` and /metrics labels them by class and outcome.
SLO_OUTCOMES = ("finished", "ttft_met", "tpot_met", "both_met")


def slo_stat_key(slo_class: str, outcome: str) -> str:
    return f"slo_{slo_class}_{outcome}"


def split_slo_key(key: str) -> tuple[str, str] | None:
    """``"slo_interactive_ttft_met"`` -> ``("interactive", "ttft_met")``; None for other keys."""
    if key.startswith("slo_"):
        for outcome in SLO_OUTCOMES:
            cls = key[len("slo_"):-len(outcome) - 1]
            if key.endswith(f"_{outcome}") and cls:
                return cls, outcome
    return None
