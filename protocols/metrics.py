"""Prometheus metrics for `/metrics` (prometheus-client, one registry per server)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from tokenloom.core.metrics import split_slo_key

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine):
        self.engine = engine
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tokenloom_requests", "Finished requests", ["finish_reason"], registry=r)
        self.overloaded = Counter("tokenloom_overloaded", "generate refused with `overloaded`", registry=r)
        self.rate_limited = Counter("tokenloom_rate_limited", "generate refused with `rate_limited`", registry=r)
        self.engine_unavailable = Counter("tokenloom_engine_unavailable",
                                          "generate refused with `engine_unavailable`", registry=r)
        self.engine_failures = Counter("tokenloom_engine_failures", "Engine steps that raised", registry=r)
        self._failures_seen = 0
        self.prompt_tokens = Counter("tokenloom_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("tokenloom_cached_prompt_tokens", "Prompt tokens served from cache", registry=r)
        self.completion_tokens = Counter("tokenloom_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("tokenloom_time_to_first_token_seconds", "TTFT", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tokenloom_time_per_output_token_seconds", "TPOT", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tokenloom_e2e_request_latency_seconds", "End to end", buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("tokenloom_num_requests_running", "Sequences running", registry=r)
        self.waiting = Gauge("tokenloom_num_requests_waiting", "Sequences waiting", registry=r)
        self.kv_usage = Gauge("tokenloom_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.hit_rate = Gauge("tokenloom_prefix_cache_hit_rate", "Prefix-cache hit rate", registry=r)
        self.preemptions = Gauge("tokenloom_num_preemptions", "Preemptions since start", registry=r)
        self.cached_blocks = Gauge("tokenloom_prefix_cache_blocks", "KV blocks held for prefix reuse", registry=r)
        self.evictions = Gauge("tokenloom_prefix_cache_evictions", "Prefix-cache evictions since start", registry=r)
        self.spec_drafted = Counter("tokenloom_spec_decode_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted = Counter("tokenloom_spec_decode_accepted_tokens", "Draft tokens accepted", registry=r)
        self.decoder = Gauge("tokenloom_decoder_stat", "Decoder counters (engine.stats() decoder_*)",
                             ["stat"], registry=r)
        self.scheduler = Gauge("tokenloom_scheduler_stat", "Scheduler counters (engine.stats() scheduler_*)",
                               ["stat"], registry=r)
        self.slo = Gauge("tokenloom_slo_requests", "Requests per SLO class: finished, and those that met "
                         "their TTFT, their TPOT, both (scheduler `slo`)", ["slo_class", "outcome"], registry=r)

    def observe_finished(self, reason: str, final) -> None:
        self.requests.labels(finish_reason=reason).inc()
        self.prompt_tokens.inc(final.usage.prompt_tokens)
        self.cached_tokens.inc(final.usage.cached_tokens)
        self.completion_tokens.inc(final.usage.completion_tokens)
        self.spec_drafted.inc(final.metrics.num_draft_tokens)
        self.spec_accepted.inc(final.metrics.num_accepted_tokens)
        if final.metrics.ttft_ms is not None:
            self.ttft.observe(final.metrics.ttft_ms / 1e3)
        if final.metrics.tpot_ms is not None:
            self.tpot.observe(final.metrics.tpot_ms / 1e3)
        self.e2e.observe(final.metrics.e2e_ms / 1e3)

    def render(self) -> str:
        s = self.engine.stats()
        failures = self.engine.health_report().engine_failures
        self.engine_failures.inc(failures - self._failures_seen)
        self._failures_seen = failures
        self.running.set(s["running"])
        self.waiting.set(s["waiting"])
        self.kv_usage.set(s["kv_usage"])
        self.hit_rate.set(s["prefix_hit_rate"])
        self.preemptions.set(s["preemptions"])
        self.cached_blocks.set(s["prefix_cached_blocks"])
        self.evictions.set(s["prefix_evictions"])
        for key, value in s.items():
            if key.startswith("decoder_"):
                self.decoder.labels(stat=key.removeprefix("decoder_")).set(value)
            elif key.startswith("scheduler_"):
                slo = split_slo_key(key.removeprefix("scheduler_"))
                if slo is not None:
                    self.slo.labels(slo_class=slo[0], outcome=slo[1]).set(value)
                else:
                    self.scheduler.labels(stat=key.removeprefix("scheduler_")).set(value)
        return generate_latest(self.registry).decode()
