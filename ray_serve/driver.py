"""RayDriver: routes requests through a pipeline whose stages are Serve deployments.

The routing is the embedded runtime's own `runtime.routing.Router` (fan-in, absent ports,
outputs to the caller, finishing a request everywhere); only its transport is replaced. Each
stage is one virtual replica (Serve picks the real one), and a message the Router would send
down a worker's pipe becomes a Serve call: a Deliver joins the request's StageCall at that
stage (opened on first delivery), an Abort cancels it. Emits streamed back from replicas go
to `Router.on_emit` as the hub would pass them.

Serve calls run on the driver's own event loop thread; the Router runs under the driver's
lock, from that thread or from a caller's (`submit`, `abort`). Readiness is Serve's: a stage
is ready when its deployment is HEALTHY.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any

from omnistage.errors import (
    DeadlineExceededError,
    RequestCancelledError,
    WorkerDiedError,
)
from omnistage.graph.inputs import check_request
from omnistage.graph.spec import PIPELINE_INPUTS, PipelineSpec
from omnistage.ray_serve.calls import DriverPermits, ReplicaLink, StageCall, StageOpener
from omnistage.ray_serve.options import deployment_name
from omnistage.runtime.ledger import SlotBook
from omnistage.runtime.lifecycle import drain_requests, refuse_unadmittable, wait_until_ready
from omnistage.runtime.messages import Abort, Deliver, Emit, PermitsTaken
from omnistage.runtime.replicas import Replica, ReplicaState
from omnistage.runtime.routing import RequestRecord, Router, Sink, safe_sink
from omnistage.runtime.shm import SegmentReader
from omnistage.runtime.threads import start_without_stop_signals

log = logging.getLogger("omnistage.ray_serve")

HEALTH_POLL_S = 0.5


class _RayRouter(Router):
    def __init__(self, driver: RayDriver, spec: PipelineSpec, permits: DriverPermits, cond: threading.Condition):
        replicas = {name: [Replica(name, 0, "ray", state=ReplicaState.READY)] for name in spec.stages}
        super().__init__(spec, replicas, permits, SlotBook(), SegmentReader(), cond)
        self.driver = driver

    def send(self, r: Replica, msg) -> None:
        if isinstance(msg, (Deliver, Abort)):
            self.driver.dispatch(r, msg)
        # PermitFreed: DriverPermits.release already woke the stage calls waiting for one


class RayDriver:
    """The Orchestrator's surface (submit, abort, readiness, stats, close) over Serve handles."""

    def __init__(self, spec: PipelineSpec, handles: dict[str, Any], app_name: str):
        self.spec = spec
        self.handles = handles  # stage -> DeploymentHandle
        self.app_name = app_name
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._permits = DriverPermits(spec, self._lock)
        self._router = _RayRouter(self, spec, self._permits, self._cond)
        self._requests = self._router.requests
        self.counts = self._router.counts
        self._calls: dict[tuple[str, str], StageCall] = {}  # (request, stage) -> its call
        self._links: dict[tuple[str, str], ReplicaLink] = {}  # (stage, replica id) -> link
        self._openers: dict[str, StageOpener] = {}
        self.channel = uuid.uuid4().hex  # names this driver to the replicas
        self.permits = self._permits
        self._health: dict[str, bool] = dict.fromkeys(spec.stages, False)
        self.started = self.closing = self.closed = False
        self.loop = asyncio.new_event_loop()
        self._permits.loop = self.loop
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"omnistage-ray-{spec.name}", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self.started:
                return
            self.started = True
        start_without_stop_signals(self._thread)
        self._health_task = asyncio.run_coroutine_threadsafe(self._watch_health(), self.loop)

    async def _watch_health(self) -> None:
        from ray import serve

        names = {deployment_name(self.spec.name, s): s for s in self.spec.stages}
        while not self.closed:
            try:
                status = await asyncio.to_thread(serve.status)
                app = status.applications.get(self.app_name)
                deployments = app.deployments if app is not None else {}
                health = {stage: getattr(deployments.get(d), "status", None) == "HEALTHY" for d, stage in names.items()}
            except Exception:  # noqa: BLE001 - the controller is restarting: not ready meanwhile
                log.debug("serve.status() failed", exc_info=True)
                health = dict.fromkeys(self.spec.stages, False)
            with self._cond:
                self._health = health
                self._cond.notify_all()
            await asyncio.sleep(HEALTH_POLL_S)

    @property
    def ready(self) -> bool:
        with self._lock:
            return self.started and not self.closed and all(self._health.values())

    def stage_ready(self) -> dict[str, bool]:
        with self._lock:
            live = self.started and not self.closed
            return {stage: live and ok for stage, ok in self._health.items()}

    def wait_ready(self, timeout: float | None = None) -> None:
        with self._cond:
            wait_until_ready(
                self._cond, self.spec.name, timeout,
                ready=lambda: self.ready, closed=lambda: self.closed,
                waiting=lambda: [s for s, ok in self._health.items() if not ok],
            )  # fmt: skip

    def close(self, drain_timeout: float = 30.0) -> None:
        with self._cond:
            if self.closed:
                return
            self.closing = True
            drain_requests(self._cond, self._requests, self._router, self.spec.name, drain_timeout)
            self.closed = True
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop_tasks(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self.loop.close()

    async def _stop_tasks(self) -> None:
        """Let the aborts just sent leave, then end every task of this loop."""
        await asyncio.sleep(0.05)
        self._health_task.cancel()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- requests -------------------------------------------------------------------------------
    def submit(
        self,
        inputs: dict[str, Any],
        params: dict[str, dict] | None,
        sink: Sink,
        request_id: str | None = None,
        deadline: float | None = None,
    ) -> str:
        spec = self.spec
        params, deadline = check_request(spec, inputs, params, deadline)
        rid = request_id or uuid.uuid4().hex
        with self._lock:
            closing = self.closing or self.closed
            refuse_unadmittable(spec, self._requests, rid, started=self.started, closing=closing, counts=self.counts)
            req = RequestRecord(rid, safe_sink(sink), params, deadline, open_stages=set(spec.stages))
            self._router.start(
                req, {p: v for p, v in inputs.items() if self._router.port_edges[PIPELINE_INPUTS].get(p)}
            )
        if deadline is not None:
            self.loop.call_soon_threadsafe(self._arm_deadline, rid, deadline)
        return rid

    def abort(self, rid: str) -> None:
        with self._lock:
            req = self._requests.get(rid)
            if req is not None:
                self._router.finish(req, RequestCancelledError(f"request {rid} was cancelled"), "cancelled")

    def return_output_credit(self, acks: list[tuple[str, str, int]]) -> None:
        """Pipeline returns the credit of output chunks its readers took (the embedded
        runtime's streaming-edge credit); stage replicas are not held back by it here."""

    def num_requests(self) -> int:
        return len(self._requests)

    def _arm_deadline(self, rid: str, deadline: float) -> None:
        self.loop.call_later(max(0.0, deadline - time.time()), self._expire, rid, deadline)

    def _expire(self, rid: str, deadline: float) -> None:
        with self._lock:
            req = self._requests.get(rid)
            if req is not None and req.deadline == deadline:
                self._router.finish(req, DeadlineExceededError(f"request {rid} exceeded its deadline"), "deadline")

    # -- the Router's messages, as Serve calls (on the driver's loop) ---------------------------
    def dispatch(self, r: Replica, msg: Deliver | Abort) -> None:
        if threading.current_thread() is self._thread:
            self._dispatch(r, msg)
        else:
            self.loop.call_soon_threadsafe(self._dispatch, r, msg)

    def _dispatch(self, r: Replica, msg: Deliver | Abort) -> None:
        key = (msg.request_id, r.stage)
        if isinstance(msg, Abort):
            call = self._calls.pop(key, None)
            if call is not None:
                call.cancel()
            return
        call = self._calls.get(key)
        if call is None:
            if msg.request_id not in self._requests:
                return  # ended before its delivery left
            call = self._calls[key] = StageCall(msg.request_id, r, self)
        call.deliver(msg)

    def opener_for(self, stage: str) -> StageOpener:
        opener = self._openers.get(stage)
        if opener is None:
            opener = self._openers[stage] = StageOpener(self.handles[stage], self.channel)
        return opener

    def link_for(self, stage: str, pin: str) -> ReplicaLink:
        link = self._links.get((stage, pin))
        if link is None:
            link = ReplicaLink(stage, pin, self.handles[stage], self.channel, self._on_emits, self._on_lost)
            self._links[(stage, pin)] = link
        return link

    def on_permits(self, rid: str, r: Replica, edges: tuple[int, ...]) -> None:
        with self._lock:
            self._router.on_permits_taken(r, PermitsTaken(rid, edges))

    def _on_emits(self, link: ReplicaLink, emits: list[Emit]) -> None:
        r = self._router.replicas[link.stage][0]
        with self._lock:
            for emit in emits:
                self._router.on_emit(r, emit)
                if emit.finished:
                    link.requests.discard(emit.request_id)
                    self._calls.pop((emit.request_id, link.stage), None)

    def _on_lost(self, link: ReplicaLink, rids: list[str], exc: BaseException) -> None:
        if link.lost and self._links.get((link.stage, link.pin)) is link:
            del self._links[(link.stage, link.pin)]
        for rid in rids:
            self.on_failure(rid, link.stage, exc)

    def on_failure(self, rid: str, stage: str, exc: BaseException) -> None:
        with self._lock:
            req = self._requests.get(rid)
            if req is not None and stage in req.open_stages:
                log.warning("request %s failed at %s: %s", rid, stage, exc)
                error = WorkerDiedError(stage, f"its replica failed ({type(exc).__name__}); retry the request")
                self._router.finish(req, error, "worker_died")

    # -- stats ----------------------------------------------------------------------------------
    def query_stats(self, timeout: float = 2.0) -> dict[str, list[dict]]:
        """One replica's figures per stage (Serve picks which)."""

        async def ask(stage: str) -> dict:
            try:
                return await asyncio.wait_for(self.handles[stage].stats.remote(), timeout)
            except Exception:  # noqa: BLE001 - stats are best effort
                return {}

        async def ask_all() -> list[dict]:
            return await asyncio.gather(*(ask(s) for s in self.spec.stages))

        if self.closed or not self._thread.is_alive():
            replies = [{} for _ in self.spec.stages]
        else:
            replies = asyncio.run_coroutine_threadsafe(ask_all(), self.loop).result(timeout + 1)
        with self._lock:
            return {
                stage: [{"replica": 0, "ready": self._health.get(stage, False), "restarts": 0, **reply}]
                for stage, reply in zip(self.spec.stages, replies)
            }
