"""Prometheus metrics of the HTTP server: what the server sees (requests, latencies) is recorded as
it happens; what the engine knows (queue lengths, KV blocks, token totals, prefix-cache hits) is read
from `engine.stats()` at scrape time, so the two can never drift apart.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Paths reported as themselves; anything else is "other", so scanners cannot grow the label set.
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

_ENGINE_GAUGES = {
    "running": ("warploop_num_requests_running", "requests being generated"),
    "waiting": ("warploop_num_requests_waiting", "requests queued for KV blocks or a batch slot"),
    "kv_blocks_used": ("warploop_kv_blocks_used", "KV-cache blocks held by requests"),
    "kv_blocks_total": ("warploop_kv_blocks_total", "KV-cache blocks in the pool"),
}
_ENGINE_COUNTERS = {
    "prefix_cache_hit_tokens": ("warploop_prefix_cache_hit_tokens", "prompt tokens served from the prefix cache"),
    "prompt_tokens_total": ("warploop_prompt_tokens", "prompt tokens processed"),
    "generation_tokens_total": ("warploop_generation_tokens", "tokens generated"),
}
# Reported by this engine beyond docs/engine-api.md; exported when present.
_OPTIONAL_COUNTERS = {
    "preemptions": ("warploop_preemptions", "requests preempted (blocks freed, recomputed later) for lack of KV"),
    "prefill_tokens_computed": ("warploop_prefill_tokens_computed", "prompt tokens run through the model "
                                "(the rest came from the prefix cache)"),
    "prefill_steps": ("warploop_prefill_steps", "steps that ran prompts (or chunks of them)"),
    "decode_steps": ("warploop_decode_steps", "decode steps the host launched one at a time"),
    "overlapped_steps": ("warploop_overlapped_steps", "decode steps launched before the previous one's tokens "
                         "reached the host"),
    "decode_loops": ("warploop_decode_loops", "decode loops the device ran (many steps a launch)"),
    "decode_loop_tokens": ("warploop_decode_loop_tokens", "tokens the device's decode loops made"),
}


# Gauges reported by this engine beyond docs/engine-api.md; exported when present.
_OPTIONAL_GAUGES = {
    "deferred_pending": ("warploop_deferred_start_pending", "engines whose deferred start work (the stream "
                         "backend's split levels) is still done while idle; 0 once settled (Engine.settle)"),
}


class _EngineCollector(Collector):
    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def collect(self) -> Iterable[Metric]:
        stats = self._engine.stats()
        for key, (name, doc) in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=stats[key])
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=stats[key])
        for key, (name, doc) in _OPTIONAL_GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=stats[key])
        for key, (name, doc) in _OPTIONAL_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(name, doc, value=stats[key])


class ServerMetrics:
    """One registry per app, so several servers (or tests) in one process do not collide."""

    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter("warploop_http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=self.registry)
        self.finished = Counter("warploop_requests_finished", "generation requests by finish reason "
                                "(abort: the client went away)", ["finish_reason"], registry=self.registry)
        self.ttft = Histogram("warploop_time_to_first_token_seconds", "arrival to first generated token",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60),
                              registry=self.registry)
        self.latency = Histogram("warploop_request_latency_seconds", "arrival to last generated token",
                                 buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300),
                                 registry=self.registry)
        self.per_token = Histogram("warploop_time_per_output_token_seconds", "decode time per token after the first",
                                   buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1),
                                   registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def request_done(self, finish_reason: str, ttft_s: float | None, latency_s: float, tokens: int) -> None:
        self.finished.labels(finish_reason).inc()
        self.latency.observe(latency_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if tokens > 1:
                self.per_token.observe((latency_s - ttft_s) / (tokens - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CountRequests:
    """ASGI middleware counting every HTTP response by route and status (streams included, errors too)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def recording_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.http_requests.labels(route, str(status)).inc()
