"""Prometheus metrics for `/metrics` (prometheus-client, one registry per server), and the
`/health` body every frontend answers."""

from __future__ import annotations

import resource

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
        # connections, every frontend (protocols/connections.py)
        self.connections_open = Gauge("tokenloom_connections_open", "Open TCP connections", ["frontend"],
                                      registry=r)
        self.connections_refused = Counter("tokenloom_connections_refused",
                                           "Connections refused over --max-connections (reason total) or "
                                           "--max-connections-per-client (reason per_client)",
                                           ["frontend", "reason"], registry=r)
        self.connection_timeouts = Counter("tokenloom_connection_timeouts",
                                           "Connections closed for a read timeout: idle (nothing sent), header, "
                                           "body, keepalive", ["frontend", "phase"], registry=r)
        self.http_protocol_errors = Counter("tokenloom_http_protocol_errors",
                                            "Requests that were not HTTP or asked for an upgrade the port does "
                                            "not offer (answered 400 / ignored, not logged)", ["kind"], registry=r)
        self.accept_errors = Counter("tokenloom_accept_errors", "accept() failures for want of file descriptors "
                                     "or memory (asyncio retries after a second)", ["errno"], registry=r)
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


def health_body(engine, *, draining: bool, full: bool) -> tuple[int, dict]:
    """`/health`: 200 while the engine can serve, 503 (with the reason) while draining,
    restarting after a failed step, or dead. ``full`` (the caller has the API key, or there
    is none): also the engine's counters, KV blocks, failures and the process's memory."""
    report = engine.health_report()
    status = "draining" if draining else report.status
    body: dict = {"status": status}
    if report.retry_after_ms is not None and not draining:
        body["retry_after_ms"] = report.retry_after_ms
    if full:
        if status != "ok":
            body["reason"] = "the server is shutting down" if draining else report.reason
        body.update(engine_failures=report.engine_failures, **engine.stats(), **process_memory())
    return (200 if status == "ok" else 503), body


def process_memory() -> dict[str, int]:
    """This process's resident memory now and at its peak, in bytes (Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        rss = peak
    return {"rss_bytes": rss, "peak_rss_bytes": peak}
