"""The orchestrator: admits requests and routes every one through the DAG.

One hub thread in the parent waits on all worker pipes and process sentinels
(multiprocessing.connection.wait). Each emission is routed along the producing port's
out-edges: to the consumer stage's replica chosen for that request (least loaded, then sticky)
or, for `outputs.*` edges, to the caller's sink. Payloads are not decoded on the way: large
tensors stay in the producer's shared segments and only small refs cross the hub.

It owns admission (bounded intake), routing, deadlines, aborts (sent to every stage holding
the request), what follows a worker's death (fails exactly the requests it held with
WorkerDiedError, then restarts it), stats queries and close. Replica state and worker
processes live in runtime/replicas.py; edge permits, shared-memory slot records and dead
workers' segments in runtime/ledger.py.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
import uuid
from collections import deque
from multiprocessing.connection import wait
from typing import Any

from omnistage.errors import (
    DeadlineExceededError,
    RequestCancelledError,
    StageError,
)
from omnistage.graph.inputs import check_request
from omnistage.graph.spec import PIPELINE_INPUTS, PipelineSpec
from omnistage.runtime.ledger import EdgePermits, SlotBook
from omnistage.runtime.lifecycle import drain_requests, refuse_unadmittable, wait_until_ready
from omnistage.runtime.messages import (
    Consumed,
    Emit,
    EmitBatch,
    OverMemory,
    PermitsTaken,
    Ready,
    StartFailed,
    StatsQuery,
    StatsReply,
    recv_msg,
)
from omnistage.runtime.recovery import Recovery
from omnistage.runtime.replicas import Replica, ReplicaState, WorkerProcesses
from omnistage.runtime.routing import RequestRecord, Router, Sink, safe_sink
from omnistage.runtime.shm import (
    SegmentPool,
    SegmentReader,
    cleanup_prefix,
    encode,
    reap_orphan_segments,
    release_all,
)
from omnistage.runtime.threads import start_background_thread
from omnistage.runtime.watchdog import check_steps, finish_drains, start_drain

log = logging.getLogger("omnistage.runtime")


class Orchestrator:
    def __init__(self, spec: PipelineSpec):
        self.spec = spec
        self.shm_prefix = f"omnistage-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._deadlines: list[tuple[float, str]] = []
        self.replicas: dict[str, list[Replica]] = {
            name: [Replica(name, i, st.pool.device_for_replica(i)) for i in range(max(1, st.pool.replicas))]
            for name, st in spec.stages.items()
        }
        self._all_replicas = [r for reps in self.replicas.values() for r in reps]
        self._workers = WorkerProcesses(spec, self.shm_prefix)
        self.stream_credit = self._workers.stream_credit  # callers return streamed outputs' credit
        self._permits = EdgePermits(spec)
        slots = SlotBook()
        self._pool = SegmentPool(f"{self.shm_prefix}-parent")
        self._reader = SegmentReader()
        self._router = Router(spec, self.replicas, self._permits, slots, self._reader, self._cond)
        self._recovery = Recovery(
            self.shm_prefix,
            self._router,
            self._permits,
            slots,
            self._pool,
            self._reader,
            self._cond,
            self._spawn,
            self._on_message,
        )
        self._requests = self._router.requests  # the requests in flight, by id
        self.counts = self._router.counts  # requests by outcome
        self._hub: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._credit_returns: deque[list[tuple[str, str, int]]] = deque()
        self._stopping = False
        self.closing = False
        self.closed = False
        self.started = False
        self._stats_seq = 0

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self.started:
                return
            self.started = True
        reaped = reap_orphan_segments()
        if reaped:
            log.info("omnistage: removed %d shared-memory files of exited pipelines", len(reaped))
        self._permits.open(self._workers.open())
        for r in self._all_replicas:
            self._spawn(r)
        self._hub = start_background_thread(self._hub_loop, f"omnistage-hub-{self.spec.name}")

    def _spawn(self, r: Replica) -> None:
        self._workers.spawn(r, self._permits.of_producer(r.stage))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    @property
    def ready(self) -> bool:
        with self._lock:
            return self.started and not self.closed and all(r.ready for r in self._all_replicas)

    def stage_ready(self) -> dict[str, bool]:
        with self._lock:
            live = self.started and not self.closed
            return {stage: live and bool(reps) and all(r.ready for r in reps) for stage, reps in self.replicas.items()}

    def start_errors(self) -> list[str]:
        return [f"{r.name}: {r.error}" for r in self._all_replicas if r.start_failed]

    def wait_ready(self, timeout: float | None = None) -> None:
        with self._cond:
            wait_until_ready(
                self._cond, self.spec.name, timeout,
                ready=lambda: self.ready, closed=lambda: self.closed,
                waiting=lambda: [r.name for r in self._all_replicas if not r.ready], check=self._raise_start_failure,
            )  # fmt: skip

    def _raise_start_failure(self) -> None:
        failed = [r for r in self._all_replicas if r.start_failed]
        if failed:
            r = failed[0]
            pos = self.spec.stages[r.stage].pos  # the stage's place in the file, as YAML errors give it
            where = f" (stage defined at {pos})" if pos is not None else ""
            raise StageError(r.stage, f"replica {r.index} failed to start: {r.error}{where}")

    def close(self, drain_timeout: float = 30.0) -> None:
        with self._cond:
            if self.closed:
                return
            self.closing = True
            drain_requests(self._cond, self._requests, self._router, self.spec.name, drain_timeout)
            self._stopping = True
            starting = self._workers.request_shutdown(self._all_replicas)
        self._wake()
        self._workers.stop_starting(starting)
        if self._hub is not None:
            self._hub.join(timeout=10)
        self._workers.join_all(self._all_replicas)
        with self._cond:
            self.closed = True
            for r in self._all_replicas:
                if r.state in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.RESTARTING):
                    r.state = ReplicaState.STOPPED
            self._cond.notify_all()
        self._permits.close()
        self._reader.close()
        self._pool.close()
        cleanup_prefix(self.shm_prefix)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- requests ------------------------------------------------------------------------------
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
        # copy input tensors into shared memory before taking the lock (a 64 MiB copy must not
        # stall routing); the slots are released again if the request is not admitted
        encoded: dict[str, Any] = {}
        for port, value in inputs.items():
            edges = self._router.port_edges[PIPELINE_INPUTS].get(port, [])
            if edges:
                encoded[port] = encode(value, self._pool, len(edges))
        try:
            return self._admit(rid, params, sink, deadline, encoded)
        except BaseException:
            for port, payload in encoded.items():
                for slot in range(len(self._router.port_edges[PIPELINE_INPUTS][port])):
                    release_all(payload, self._reader, slot)
            raise

    def _admit(self, rid: str, params: dict, sink: Sink, deadline: float | None, encoded: dict[str, Any]) -> str:
        spec = self.spec
        with self._lock:
            closing = self.closing or self.closed
            refuse_unadmittable(spec, self._requests, rid, started=self.started, closing=closing, counts=self.counts)
            req = RequestRecord(rid, safe_sink(sink), params, deadline, open_stages=set(spec.stages))
            if deadline is not None:
                heapq.heappush(self._deadlines, (deadline, rid))
                self._wake()
            self._router.start(req, encoded)
        return rid

    def abort(self, rid: str) -> None:
        with self._lock:
            req = self._requests.get(rid)
            if req is not None:
                self._router.finish(req, RequestCancelledError(f"request {rid} was cancelled"), "cancelled")

    def num_requests(self) -> int:
        return len(self._requests)

    def return_output_credit(self, acks: list[tuple[str, str, int]]) -> None:
        """The caller consumed chunks of streaming outputs: (request id, port, chunks) each.
        Handed to the hub thread: the caller's event loop neither waits for the hub's lock nor
        writes to the workers' pipes once per turn."""
        self._credit_returns.append(acks)
        self._wake()

    def _route_credit_returns(self) -> None:
        while self._credit_returns:
            self._router.return_output_credit(self._credit_returns.popleft())

    # -- hub thread -----------------------------------------------------------------------------
    def _hub_loop(self) -> None:
        while True:
            with self._lock:
                if self._stopping and all(r.conn is None or not r.proc.is_alive() for r in self._all_replicas):
                    return
                by_conn = {r.conn: r for r in self._all_replicas if r.conn is not None}
                by_sentinel = {r.proc.sentinel: r for r in self._all_replicas if r.conn is not None}
                timeout = 0.5
                if self._deadlines:
                    timeout = max(0.0, min(timeout, self._deadlines[0][0] - time.time()))
            if self._stopping:
                timeout = min(timeout, 0.05)
            try:
                ready = wait([*by_conn, *by_sentinel, self._wake_r], timeout)
            except OSError:
                ready = []
            dead: list[Replica] = []
            for obj in ready:
                if obj == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except OSError:
                        pass
                elif obj in by_conn:
                    if not self._read_messages(by_conn[obj]):
                        dead.append(by_conn[obj])
                else:
                    dead.append(by_sentinel[obj])
            with self._lock:
                self._route_credit_returns()
                for r in dict.fromkeys(dead):
                    self._handle_exit(r)
                self._expire_deadlines()
                self._recovery.reap_dead_segments()
                if not self._stopping:
                    check_steps(self._all_replicas, self.spec)
                    finish_drains(self._all_replicas)

    def _read_messages(self, r: Replica) -> bool:
        """Handle what a worker's pipe holds; False once the pipe is closed."""
        conn = r.conn
        try:
            while True:
                msg = recv_msg(conn)
                with self._lock:
                    try:
                        self._on_message(r, msg)
                    except Exception:  # noqa: BLE001 - one bad message must not stop routing
                        log.exception("omnistage: failed to handle %s from %s", type(msg).__name__, r.name)
                if not conn.poll():
                    return True
        except (EOFError, OSError):
            return False

    def _handle_exit(self, r: Replica) -> None:
        if r.conn is None:
            return
        if self._stopping:
            r.close_conn()  # orderly exit after Shutdown
            return
        try:
            self._recovery.on_death(r, stopping=self._stopping or self.closing)
        except Exception:  # noqa: BLE001 - the hub must keep routing
            log.exception("omnistage: handling the death of %s failed", r.name)

    def _on_message(self, r: Replica, msg) -> None:
        if isinstance(msg, Emit):
            self._router.on_emit(r, msg)
        elif isinstance(msg, EmitBatch):
            for emit in msg.emits:
                self._router.on_emit(r, emit)
        elif isinstance(msg, PermitsTaken):
            self._router.on_permits_taken(r, msg)
        elif isinstance(msg, Consumed):
            self._router.return_credit(msg.grants)
        elif isinstance(msg, OverMemory):
            start_drain(r, msg.rss)
        elif isinstance(msg, StatsReply):
            r.last_stats = msg.stats
            r.last_stats["seq"] = msg.seq
            self._cond.notify_all()
        elif isinstance(msg, Ready):
            r.mark_ready(msg.pid)
            pending, r.pending = r.pending, []
            for m in pending:
                self._router.send(r, m)
            self._cond.notify_all()
        elif isinstance(msg, StartFailed):
            log.error(
                "omnistage: %s failed to start: %s%s", r.name, msg.error, f"\n{msg.traceback}" * bool(msg.traceback)
            )
            r.mark_start_error(msg.error)
            self._cond.notify_all()

    def _expire_deadlines(self) -> None:
        now = time.time()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, rid = heapq.heappop(self._deadlines)
            req = self._requests.get(rid)
            if req is not None and req.deadline == deadline:
                self._router.finish(req, DeadlineExceededError(f"request {rid} exceeded its deadline"), "deadline")

    # -- stats ----------------------------------------------------------------------------------
    def query_stats(self, timeout: float = 2.0) -> dict[str, list[dict]]:
        with self._cond:
            if self.closed:
                timeout = 0.0
            self._stats_seq += 1
            seq = self._stats_seq
            asked = [r for r in self._all_replicas if r.ready]
            for r in asked:
                self._router.send(r, StatsQuery(seq))
            end = time.monotonic() + timeout
            while any(r.ready and r.last_stats.get("seq") != seq for r in asked) and time.monotonic() < end:
                self._cond.wait(max(0.0, end - time.monotonic()))
            return {
                stage: [
                    {
                        "replica": r.index,
                        "ready": r.ready,
                        "restarts": r.restarts,
                        "recycles": r.recycles,
                        "held_requests": len(r.requests),
                        **{k: v for k, v in r.last_stats.items() if k != "seq"},
                    }
                    for r in reps
                ]
                for stage, reps in self.replicas.items()
            }
