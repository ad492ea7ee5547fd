"""Prometheus metrics of one app: HTTP counters of its own plus the runtime's per-stage series.

Each app has its own CollectorRegistry (several apps in one test process never collide).
Per-stage figures come from omnistage.runtime.metrics.PipelineMetricsCollector, rebuilt at
every scrape over the pipelines constructed so far (pipelines load after the server starts).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import Collector

log = logging.getLogger("omnistage.serving")

PROMETHEUS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _LivePipelinesCollector(Collector):
    def __init__(self, registry: Any):
        self._registry = registry

    def collect(self):
        pipelines = self._registry.pipelines()
        if not pipelines:
            return
        try:
            from omnistage.runtime.metrics import PipelineMetricsCollector
        except ImportError:  # runtime without metrics: serve HTTP series only
            return
        try:
            yield from PipelineMetricsCollector(list(pipelines.values())).collect()
        except Exception:  # noqa: BLE001 - a scrape must not fail because a pipeline is closing
            log.exception("collecting pipeline metrics failed")


class ServingMetrics:
    def __init__(self, registry: Any):
        self.prom = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "omnistage_http_requests",
            "HTTP requests answered, by route and status",
            ["method", "route", "status"],
            registry=self.prom,
        )
        self.latency = Histogram(
            "omnistage_http_request_duration_seconds",
            "Time to the end of the response body",
            ["method", "route"],
            registry=self.prom,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.inflight = Gauge(
            "omnistage_http_inflight_requests", "HTTP requests doing work now (probes excluded)", registry=self.prom
        )
        self.inflight.set_function(lambda: registry.inflight)
        self.ready = Gauge("omnistage_ready", "1 when every stage of every pipeline is ready", registry=self.prom)
        self.ready.set_function(lambda: 1.0 if registry.ready else 0.0)
        self.draining = Gauge("omnistage_draining", "1 while the server drains before exit", registry=self.prom)
        self.draining.set_function(lambda: 1.0 if registry.draining else 0.0)
        self.realtime_preemptive = Counter(
            "omnistage_realtime_preemptive_responses",
            "Realtime responses started at a pause in the user's speech, by outcome: used (the turn "
            "ended there) or discarded (the user went on; the work was aborted)",
            ["outcome"],
            registry=self.prom,
        )
        self.prom.register(_LivePipelinesCollector(registry))

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.prom)
