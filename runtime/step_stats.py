"""A worker's running figures about its engine steps (batch sizes, step times, outcomes),
reported in its stats snapshot and exported as histograms by runtime/metrics.py."""

from __future__ import annotations

from collections import deque

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_MS_BUCKETS = (0.5, 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000)


class StepStats:
    def __init__(self):
        self.batch_size_last = 0
        self.step_ms: deque[float] = deque(maxlen=256)
        self.batch_hist = [0] * (len(BATCH_BUCKETS) + 1)
        self.step_hist = [0] * (len(STEP_MS_BUCKETS) + 1)
        self.batch_sum = 0
        self.step_ms_sum = 0.0
        self.steps = 0
        self.outcomes = {"ok": 0, "error": 0, "aborted": 0}

    def record_step(self, batch: int, ms: float) -> None:
        self.batch_size_last = batch
        self.step_ms.append(ms)
        self.steps += 1
        self.batch_sum += batch
        self.step_ms_sum += ms
        self.batch_hist[_bucket(BATCH_BUCKETS, batch)] += 1
        self.step_hist[_bucket(STEP_MS_BUCKETS, ms)] += 1


def _bucket(bounds, value) -> int:
    for i, b in enumerate(bounds):
        if value <= b:
            return i
    return len(bounds)
