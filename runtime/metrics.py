"""Prometheus export of the runtime's per-stage figures.

    registry.register(PipelineMetricsCollector([pipeline, ...]))

Every scrape asks each ready worker for fresh figures (Pipeline.replica_stats) and yields,
labelled by pipeline / stage / replica: queue depth, requests in flight, last batch size,
batch-size and step-time histograms, requests by outcome, restarts, readiness, and every
numeric engine.stats() value as `omnistage_engine_<name>`. Pipeline-level request counts by
outcome and in-flight requests are labelled by pipeline only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from omnistage.runtime.step_stats import BATCH_BUCKETS, STEP_MS_BUCKETS

_LABELS = ["pipeline", "stage", "replica"]


def _metric_name(stat: str) -> str:
    return "omnistage_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", stat)


def _buckets(bounds, counts, scale=1.0):
    out, total = [], 0
    for bound, count in zip(bounds, counts):
        total += count
        out.append((repr(float(bound) * scale), total))
    total += counts[len(bounds)]
    out.append(("+Inf", total))
    return out


class PipelineMetricsCollector(Collector):
    def __init__(self, pipelines: Iterable, stats_timeout: float = 1.0):
        self.pipelines = list(pipelines)
        self.stats_timeout = stats_timeout

    def collect(self):
        queue = GaugeMetricFamily(
            "omnistage_stage_queue_depth", "Requests at the stage waiting for inputs or admission", labels=_LABELS
        )
        inflight = GaugeMetricFamily(
            "omnistage_stage_inflight_requests", "Requests inside the stage's engine", labels=_LABELS
        )
        batch_last = GaugeMetricFamily(
            "omnistage_stage_batch_size_last", "Requests in the last engine step", labels=_LABELS
        )
        ready = GaugeMetricFamily(
            "omnistage_stage_ready", "1 when the replica's engine is built and serving", labels=_LABELS
        )
        batch_hist = HistogramMetricFamily("omnistage_stage_batch_size", "Requests per engine step", labels=_LABELS)
        step_hist = HistogramMetricFamily("omnistage_stage_step_seconds", "Engine step duration", labels=_LABELS)
        outcomes = CounterMetricFamily(
            "omnistage_stage_requests", "Requests that left the stage, by outcome", labels=_LABELS + ["outcome"]
        )
        restarts = CounterMetricFamily(
            "omnistage_stage_restarts", "Worker restarts after a worker died", labels=_LABELS
        )
        p_requests = CounterMetricFamily(
            "omnistage_pipeline_requests", "Pipeline requests, by outcome", labels=["pipeline", "outcome"]
        )
        p_inflight = GaugeMetricFamily(
            "omnistage_pipeline_inflight_requests", "Requests admitted and not finished", labels=["pipeline"]
        )
        engine: dict[str, GaugeMetricFamily] = {}
        for p in self.pipelines:
            if getattr(p, "closed", False):
                continue
            name = p.name
            for outcome, n in p.request_counts.items():
                p_requests.add_metric([name, outcome], n)
            p_inflight.add_metric([name], p.num_requests())
            for stage, reps in p.replica_stats(self.stats_timeout).items():
                for r in reps:
                    labels = [name, stage, str(r["replica"])]
                    ready.add_metric(labels, 1.0 if r.get("ready") else 0.0)
                    restarts.add_metric(labels, r.get("restarts", 0))
                    if "steps" not in r:
                        continue  # no figures yet (starting)
                    queue.add_metric(labels, r["queue_depth"])
                    inflight.add_metric(labels, r["inflight"])
                    batch_last.add_metric(labels, r["batch_size_last"])
                    batch_hist.add_metric(labels, _buckets(BATCH_BUCKETS, r["batch_hist"]), r["batch_sum"])
                    step_hist.add_metric(
                        labels, _buckets(STEP_MS_BUCKETS, r["step_hist"], 1e-3), r["step_ms_sum"] / 1000.0
                    )
                    for outcome, n in r.get("outcomes", {}).items():
                        outcomes.add_metric(labels + [outcome], n)
                    for stat, value in (r.get("engine") or {}).items():
                        if isinstance(value, (int, float)) and not isinstance(value, bool):
                            fam = engine.get(stat)
                            if fam is None:
                                fam = engine[stat] = GaugeMetricFamily(
                                    _metric_name(stat), f"Engine figure {stat!r}", labels=_LABELS
                                )
                            fam.add_metric(labels, float(value))
        yield from (
            queue,
            inflight,
            batch_last,
            ready,
            batch_hist,
            step_hist,
            outcomes,
            restarts,
            p_requests,
            p_inflight,
        )
        yield from engine.values()
