"""Step-level continuous batching for denoisers.

Every request is a DenoiseState with its own latents, generator and scheduler copy. One call
to `StepEngine.step()` runs ONE transformer forward for a group of requests from the same
bucket (equal latent shape / conditioning length / model), each at its own timestep, then
advances each of them by one scheduler step. Requests join and leave between steps.

Bucket policy (least remaining work first, with an aging bound):
- the engine serves the active bucket whose next batch is closest to finishing a request:
  priority = (fewest remaining steps among the batch's requests) x (the batch's work, rows x
  latent tokens), i.e. the denoiser work until that bucket's next completion. A small request
  arriving while a big one runs is served from the next step boundary and finishes first;
- aging: every forward adds its work to the `passed_over` count of each other active bucket.
  A bucket passed over for more than `aging_factor` x its own next forward's work (or, when
  `aging_wait_s` is set, not served for that many seconds) is served next, so a big request
  always gets at least ~1/(1 + aging_factor) of the denoiser while it is active: no
  starvation. Several aged buckets: the most passed over (relative to its forward) first;
- ties: the least recently served bucket, then arrival order.
Within a bucket, requests join the forward in arrival order under the per-step budget
(max_batch_size images and optionally max_latent_tokens); the oldest request always fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.base import StepRecord
from omnistage.stages.diffusion.adapters.base import DenoiserAdapter, DenoiseState


@dataclass
class StepEvent:
    """What one step did for one request."""

    request_id: str
    progress: tuple[int, int]
    finished: bool = False
    latents: torch.Tensor | None = None  # VAE-layout latents when finished
    error: str | None = None
    error_kind: str = "internal"
    preview: torch.Tensor | None = None  # estimated clean latents after a preview step


@dataclass
class _Bucket:
    key: Hashable
    states: list[DenoiseState] = field(default_factory=list)
    passed_over: float = 0.0  # other buckets' forward work since this one was last served
    waiting_since: float = 0.0  # clock() when last served or (re)activated
    forwards: int = 0
    last_served: int = -1  # engine forward counter when last served (-1: never)


class StepEngine:
    def __init__(
        self,
        adapter: DenoiserAdapter,
        max_batch_size: int = 8,
        max_latent_tokens: int | None = None,
        step_log_limit: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        aging_factor: float = 4.0,
        aging_wait_s: float | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if aging_factor < 0:
            raise ValueError("aging_factor must be >= 0")
        self.aging_factor = float(aging_factor)
        self.aging_wait_s = aging_wait_s
        self.adapter = adapter
        self.max_batch_size = max_batch_size
        self.max_latent_tokens = max_latent_tokens
        self.step_log: list[StepRecord] = []
        self.step_log_limit = step_log_limit
        self.clock = clock
        self._buckets: dict[Hashable, _Bucket] = {}
        self._index: dict[str, DenoiseState] = {}
        self._stepping = False
        self._deferred_aborts: set[str] = set()
        self.completed = 0
        self.aborted = 0
        # cumulative batch record for /metrics and cross-process tests (the step_log stays in
        # the worker): forwards, request-steps they carried, forwards whose members were at
        # different step indices, the most requests one forward held, arrival->first-step wait
        self.forwards_total = 0
        self.request_steps_total = 0
        self.mixed_step_forwards = 0
        self.max_requests_per_forward = 0
        self.queue_wait_s_total = 0.0
        self.queue_wait_count = 0

    # -- membership -----------------------------------------------------------------------
    def add(self, state: DenoiseState) -> None:
        if state.request_id in self._index:
            raise ValueError(f"request {state.request_id!r} is already in the engine")
        bucket = self._buckets.get(state.bucket)
        if bucket is None:
            bucket = self._buckets[state.bucket] = _Bucket(state.bucket)
        if not bucket.states:  # (re)activated: its aging starts now
            bucket.passed_over = 0.0
            bucket.waiting_since = self.clock()
        bucket.states.append(state)
        self._index[state.request_id] = state

    def abort(self, request_id: str) -> bool:
        """Drop a request; takes effect now, or at the end of a step in progress."""
        if request_id not in self._index:
            return False
        if self._stepping:
            self._deferred_aborts.add(request_id)
            return True
        self._remove(request_id)
        self.aborted += 1
        return True

    def _remove(self, request_id: str) -> None:
        state = self._index.pop(request_id, None)
        if state is None:
            return
        bucket = self._buckets.get(state.bucket)
        if bucket is not None:
            bucket.states = [s for s in bucket.states if s.request_id != request_id]
            if not bucket.states:
                # keep the (empty) bucket for a later re-activation; forget them when many
                if len(self._buckets) > 64:
                    del self._buckets[bucket.key]
        self.adapter.forget(request_id)
        # free the request's tensors now rather than when the state is collected
        state.latents = None  # type: ignore[assignment]
        state.row_inputs = {}
        state.shared = {}

    def has_work(self) -> bool:
        return bool(self._index)

    def num_requests(self) -> int:
        return len(self._index)

    def request_ids(self) -> list[str]:
        return list(self._index)

    def state(self, request_id: str) -> DenoiseState | None:
        return self._index.get(request_id)

    def stats(self) -> dict[str, float]:
        active = [b for b in self._buckets.values() if b.states]
        return {
            "requests": float(len(self._index)),
            "buckets_active": float(len(active)),
            "completed": float(self.completed),
            "aborted": float(self.aborted),
            "forwards_total": float(self.forwards_total),
            "request_steps_total": float(self.request_steps_total),
            "mixed_step_forwards": float(self.mixed_step_forwards),
            "max_requests_per_forward": float(self.max_requests_per_forward),
            "queue_wait_ms_mean": 1000.0 * self.queue_wait_s_total / max(1, self.queue_wait_count),
        }

    def bucket_priorities(self) -> dict[Hashable, float]:
        """Remaining-work priority of every active bucket (smallest served first, unless aged)."""
        return {b.key: self._remaining_work(b) for b in self._buckets.values() if b.states}

    # -- scheduling -----------------------------------------------------------------------
    def _remaining_work(self, bucket: _Bucket) -> float:
        batch = self.pick_batch(bucket)
        return float(min(s.total_steps - s.step_index for s in batch) * sum(s.cost for s in batch))

    def _aged(self, bucket: _Bucket, now: float) -> float | None:
        """How far past its aging bound the bucket is (None: within it)."""
        own = float(sum(s.cost for s in self.pick_batch(bucket)))
        over = bucket.passed_over / max(own, 1.0)
        if over > self.aging_factor:
            return over
        if self.aging_wait_s is not None and now - bucket.waiting_since > self.aging_wait_s:
            return float("inf")
        return None

    def pick_bucket(self) -> _Bucket | None:
        active = [b for b in self._buckets.values() if b.states]
        if not active:
            return None
        if len(active) == 1:
            return active[0]
        now = self.clock()
        aged = [(a, b) for b in active if (a := self._aged(b, now)) is not None]
        if aged:
            return max(aged, key=lambda ab: (ab[0], -ab[1].last_served))[1]
        order = lambda b: (self._remaining_work(b), b.last_served, b.states[0].arrival)  # noqa: E731
        return min(active, key=order)

    def pick_batch(self, bucket: _Bucket) -> list[DenoiseState]:
        batch: list[DenoiseState] = []
        images = 0
        tokens = 0
        for s in bucket.states:  # arrival order
            n = int(s.latents.shape[0])
            if batch and images + n > self.max_batch_size:
                break
            if batch and self.max_latent_tokens is not None and tokens + s.cost > self.max_latent_tokens:
                break
            batch.append(s)
            images += n
            tokens += s.cost
        return batch

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        bucket = self.pick_bucket()
        if bucket is None:
            return []
        batch = self.pick_batch(bucket)
        self._stepping = True
        try:
            events = self._run(batch, bucket)
        finally:
            self._stepping = False
        for rid in self._deferred_aborts:
            self._remove(rid)
            self.aborted += 1
        dropped = self._deferred_aborts
        self._deferred_aborts = set()
        return [e for e in events if e.request_id not in dropped]

    def _run(self, batch: list[DenoiseState], bucket: _Bucket) -> list[StepEvent]:
        t0 = self.clock()
        now = time.monotonic()
        for s in batch:
            if s.first_step_at is None:
                s.first_step_at = now
                self.queue_wait_s_total += max(0.0, now - s.arrival)
                self.queue_wait_count += 1
        step_indices = [s.step_index for s in batch]
        self.forwards_total += 1
        self.request_steps_total += len(batch)
        self.mixed_step_forwards += int(len(set(step_indices)) > 1)
        self.max_requests_per_forward = max(self.max_requests_per_forward, len(batch))
        # host copies of the schedules (one device sync per request, not one per step)
        timesteps = [s.extra.setdefault("_timesteps_host", s.timesteps.tolist())[s.step_index] for s in batch]
        failed: dict[str, BaseException] = {}
        try:
            outputs = self.adapter.forward(batch)
            for s, out in zip(batch, outputs):
                self.adapter.step(s, out)
        except Exception:  # noqa: BLE001 - isolate the culprit: retry each request alone
            outputs = None
            for s in batch:
                if s.step_index != step_indices[batch.index(s)]:
                    continue  # already advanced before the failure
                try:
                    (out,) = self.adapter.forward([s])
                    self.adapter.step(s, out)
                except Exception as exc:  # noqa: BLE001
                    failed[s.request_id] = exc
        duration = self.clock() - t0
        work = float(sum(s.cost for s in batch))
        for other in self._buckets.values():
            if other is not bucket and other.states:
                other.passed_over += work
        bucket.passed_over = 0.0
        bucket.waiting_since = self.clock()
        bucket.forwards += 1
        bucket.last_served = self.forwards_total
        self._log(
            StepRecord(
                request_ids=tuple(s.request_id for s in batch),
                batch_size=sum(int(s.latents.shape[0]) for s in batch if s.latents is not None),
                duration_s=duration,
                extra={
                    "bucket": bucket.key,
                    "rows": sum(s.rows for s in batch),
                    "step_indices": step_indices,
                    "timesteps": timesteps,
                },
            )
        )
        events: list[StepEvent] = []
        for s in batch:
            rid = s.request_id
            if rid in failed:
                exc = failed[rid]
                kind = "invalid_request" if isinstance(exc, InvalidRequestError) else "internal"
                events.append(
                    StepEvent(rid, (s.step_index, s.total_steps), True, None, f"{type(exc).__name__}: {exc}", kind)
                )
                self._remove(rid)
                continue
            progress = (s.step_index, s.total_steps)
            if s.done:
                try:
                    latents = self.adapter.finish(s)
                except Exception as exc:  # noqa: BLE001
                    events.append(StepEvent(rid, progress, True, None, f"{type(exc).__name__}: {exc}"))
                else:
                    events.append(StepEvent(rid, progress, True, latents))
                    self.completed += 1
                self._remove(rid)
            else:
                events.append(StepEvent(rid, progress, preview=s.extra.pop("preview", None)))
        return events

    def _log(self, record: StepRecord) -> None:
        self.step_log.append(record)
        if len(self.step_log) > self.step_log_limit:
            del self.step_log[: len(self.step_log) - self.step_log_limit]

    def run_until_done(self, on_event: Callable[[StepEvent], Any] | None = None) -> dict[str, StepEvent]:
        """Step until empty (for tests and benchmarks); returns each request's final event."""
        finals: dict[str, StepEvent] = {}
        while self.has_work():
            for ev in self.step():
                if on_event is not None:
                    on_event(ev)
                if ev.finished:
                    finals[ev.request_id] = ev
        return finals
