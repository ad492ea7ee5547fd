"""The orchestrator: starts stage workers and routes every request through the DAG.

One hub thread in the parent waits on all worker pipes and process sentinels
(multiprocessing.connection.wait). Each emission is routed along the producing port's
out-edges: to the consumer stage's replica chosen for that request (least loaded, then sticky)
or, for `outputs.*` edges, to the caller's sink. Payloads are not decoded on the way: large
tensors stay in the producer's shared segments and only small refs cross the hub.

It also owns: admission (bounded intake), deadlines, aborts (sent to every stage holding the
request), in-flight permits of edges with max_inflight, worker death (fails exactly the
requests that worker held with WorkerDiedError, then restarts it), stats queries, and close.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import multiprocessing
import multiprocessing.spawn as mp_spawn
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from omnistage.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    OverloadedError,
    PipelineClosedError,
    RequestCancelledError,
    StageError,
    WorkerDiedError,
)
from omnistage.graph.spec import PIPELINE_INPUTS, PIPELINE_OUTPUTS, PipelineSpec
from omnistage.runtime.messages import (
    Abort,
    Deliver,
    Emit,
    EmitBatch,
    ForgetSegments,
    PermitFreed,
    PermitsTaken,
    Ready,
    ReleaseSlots,
    RequestMeta,
    Shutdown,
    StartFailed,
    StatsQuery,
    StatsReply,
    recv_msg,
    send_msg,
)
from omnistage.runtime.openmp import apply_openmp_defaults
from omnistage.runtime.shm import SegmentPool, SegmentReader, cleanup_prefix, decode, encode, iter_refs, release_all
from omnistage.runtime.worker import WorkerConfig, port_out_edges, worker_main
from omnistage.stages.dynamic import combine_chunks

log = logging.getLogger("omnistage.runtime")

MAX_RESTART_FAILURES = 3
# close(): a replica still building its engine gets this long to act on Shutdown, then SIGKILL
STARTING_STOP_GRACE_S = 1.0
BASE_PRELOAD = ["torch", "omnistage.runtime.worker", "omnistage.stages.generic"]
# Imported once by the fork server so every worker starts with them loaded (copy-on-write)
# instead of paying seconds each; override with OMNISTAGE_PRELOAD="mod1,mod2" ("" for none).
DEFAULT_EXTRA_PRELOAD = ["transformers", "diffusers"]


def preload_modules() -> list[str]:
    extra = os.environ.get("OMNISTAGE_PRELOAD")
    mods = DEFAULT_EXTRA_PRELOAD if extra is None else [m.strip() for m in extra.split(",") if m.strip()]
    return BASE_PRELOAD + [m for m in mods if m not in BASE_PRELOAD]


def mp_context():
    # Stage workers share the machine's cores: bounded OpenMP spin-waiting (runtime.openmp).
    # The fork server reads it when it imports torch, so it is set first.
    apply_openmp_defaults()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload_modules())  # only matters before the fork server starts
    return ctx


_start_lock = threading.Lock()


@contextlib.contextmanager
def _without_main_reimport():
    """Workers never need the caller's __main__: keep multiprocessing from re-running the
    caller's script in the fork server and in each worker (so a plain script without an
    `if __name__ == "__main__"` guard can build pipelines)."""
    original = mp_spawn.get_preparation_data

    def preparation_data(name):
        data = original(name)
        for key in ("init_main_from_path", "init_main_from_name", "main_path"):
            data.pop(key, None)
        return data

    with _start_lock:
        mp_spawn.get_preparation_data = preparation_data
        try:
            yield
        finally:
            mp_spawn.get_preparation_data = original


@dataclass
class OutputChunk:
    request_id: str
    port: str | None  # None for a progress-only chunk
    data: Any
    final: bool  # last chunk of this port (data may be None when the producer had nothing more)
    progress: tuple[int, int] | None = None
    stage: str | None = None


@dataclass
class RequestEnd:
    """Last item put in a request's sink; error None means success."""

    request_id: str
    error: BaseException | None = None


Sink = Callable[[Any], None]


@dataclass(eq=False)
class Replica:
    stage: str
    index: int
    device: str
    generation: int = 0
    proc: Any = None
    conn: Any = None
    ready: bool = False
    ever_ready: bool = False
    pid: int | None = None
    pending: list = field(default_factory=list)  # messages held while the worker starts
    requests: set = field(default_factory=set)  # request ids routed here, not finished here
    start_error: str | None = None
    restart_failures: int = 0
    restarts: int = 0
    last_stats: dict = field(default_factory=dict)
    dead: bool = False  # gave up restarting

    @property
    def name(self) -> str:
        return f"{self.stage}[{self.index}]"


def _safe_sink(sink: Sink) -> Sink:
    def put(item: Any) -> None:
        try:
            sink(item)
        except Exception:  # noqa: BLE001 - a caller gone (closed event loop) must not stop the hub
            log.debug("dropping an item for a caller that went away", exc_info=True)

    return put


@dataclass(eq=False)
class _Request:
    rid: str
    sink: Sink
    params: dict[str, dict]
    deadline: float | None
    replicas: dict[str, Replica] = field(default_factory=dict)
    open_stages: set = field(default_factory=set)
    hub_permits: set = field(default_factory=set)  # edge indices whose permit the hub must return
    out_buffers: dict = field(default_factory=dict)  # non-streaming output edge -> chunks so far
    # stage -> (producer replica or None for the caller's inputs, its generation, segment, use,
    # slot) of every shared-memory slot delivered to that stage, kept until the stage finishes
    # the request: what to release for it if its worker dies first
    sent_slots: dict = field(default_factory=dict)


class Orchestrator:
    def __init__(self, spec: PipelineSpec):
        self.spec = spec
        self.shm_prefix = f"omnistage-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._requests: dict[str, _Request] = {}
        self._deadlines: list[tuple[float, str]] = []
        self.replicas: dict[str, list[Replica]] = {
            name: [Replica(name, i, st.pool.device_for_replica(i)) for i in range(max(1, st.pool.replicas))]
            for name, st in spec.stages.items()
        }
        self._port_edges = {name: port_out_edges(spec, name) for name in list(spec.stages) + [PIPELINE_INPUTS]}
        self._in_edge_idx = {name: [i for i, e in enumerate(spec.edges) if e.dst.stage == name] for name in spec.stages}
        self._sources = [n for n in spec.stages if not self._in_edge_idx[n]]
        self._permits: dict[int, Any] = {}
        self._pool = SegmentPool(f"{self.shm_prefix}-parent")
        self._reader = SegmentReader()
        self._ctx = None
        self._hub: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self.closing = False
        self.closed = False
        self.started = False
        self._stats_seq = 0
        self._dead_segments: list[tuple[str, set]] = []  # (dead worker's file prefix, requests it may feed)
        self.counts = {
            k: 0 for k in ("ok", "error", "invalid", "cancelled", "deadline", "rejected", "worker_died", "closed")
        }

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self.started:
                return
            self.started = True
        self._ctx = mp_context()
        for i, e in enumerate(self.spec.edges):
            if e.max_inflight and e.src.stage in self.spec.stages:
                self._permits[i] = self._ctx.Semaphore(int(e.max_inflight))
        for reps in self.replicas.values():
            for r in reps:
                self._spawn(r)
        self._hub = threading.Thread(target=self._hub_loop, name=f"omnistage-hub-{self.spec.name}", daemon=True)
        self._hub.start()

    def _spawn(self, r: Replica) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        permits = {i: s for i, s in self._permits.items() if self.spec.edges[i].src.stage == r.stage}
        cfg = WorkerConfig(self.spec, r.stage, r.index, r.device, self.shm_prefix, permits, r.generation)
        proc = self._ctx.Process(
            target=worker_main, args=(cfg, child_conn), name=f"omnistage:{self.spec.name}:{r.name}", daemon=True
        )
        with _without_main_reimport():
            proc.start()
        child_conn.close()
        r.proc, r.conn, r.ready, r.pid = proc, parent_conn, False, proc.pid
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    @property
    def ready(self) -> bool:
        with self._lock:
            return self.started and not self.closed and all(r.ready for reps in self.replicas.values() for r in reps)

    def stage_ready(self) -> dict[str, bool]:
        with self._lock:
            live = self.started and not self.closed
            return {stage: live and bool(reps) and all(r.ready for r in reps) for stage, reps in self.replicas.items()}

    def start_errors(self) -> list[str]:
        return [
            f"{r.name}: {r.start_error}"
            for reps in self.replicas.values()
            for r in reps
            if r.start_error and not r.ever_ready
        ]

    def wait_ready(self, timeout: float | None = None) -> None:
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                failed = [r for reps in self.replicas.values() for r in reps if r.start_error and not r.ever_ready]
                if failed:
                    r = failed[0]
                    raise StageError(r.stage, f"replica {r.index} failed to start: {r.start_error}")
                if self.ready:
                    return
                if self.closed:
                    raise PipelineClosedError(f"pipeline {self.spec.name!r} is closed")
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    waiting = [r.name for reps in self.replicas.values() for r in reps if not r.ready]
                    raise TimeoutError(
                        f"pipeline {self.spec.name!r}: not ready after {timeout}s (waiting for {', '.join(waiting)})"
                    )
                self._cond.wait(left if left is not None else 1.0)

    def close(self, drain_timeout: float = 30.0) -> None:
        with self._cond:
            if self.closed:
                return
            self.closing = True
            end = time.monotonic() + max(0.0, drain_timeout)
            while self._requests and time.monotonic() < end:
                self._cond.wait(min(0.1, max(0.0, end - time.monotonic())))
            for req in list(self._requests.values()):
                self._finish(
                    req,
                    PipelineClosedError(f"pipeline {self.spec.name!r} closed before the request finished"),
                    "closed",
                )
            self._stopping = True
            starting = []
            for reps in self.replicas.values():
                for r in reps:
                    if r.conn is not None:  # a worker still building its engine exits on it at once
                        try:
                            send_msg(r.conn, Shutdown())
                        except OSError:
                            pass
                        if not r.ready:
                            starting.append(r)
        self._wake()
        # A replica still building its engine (loading weights can take minutes) holds no
        # request: give it a moment to act on Shutdown, then kill it rather than wait.
        grace_end = time.monotonic() + STARTING_STOP_GRACE_S
        for r in starting:
            r.proc.join(timeout=max(0.0, grace_end - time.monotonic()))
        for r in starting:
            if r.proc.is_alive():
                r.proc.kill()
        if self._hub is not None:
            self._hub.join(timeout=10)
        deadline = time.monotonic() + 5.0
        for reps in self.replicas.values():
            for r in reps:
                if r.proc is None:
                    continue
                r.proc.join(timeout=max(0.0, deadline - time.monotonic()))
                if r.proc.is_alive():
                    r.proc.kill()
                    r.proc.join(timeout=5)
                if r.conn is not None:
                    try:
                        r.conn.close()
                    except OSError:
                        pass
                    r.conn = None
        with self._cond:
            self.closed = True
            for reps in self.replicas.values():
                for r in reps:
                    r.ready = False
            self._cond.notify_all()
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
        if not isinstance(inputs, dict):
            raise InvalidRequestError("inputs must be a dict {pipeline input port: value}")
        unknown = set(inputs) - set(spec.inputs)
        if unknown:
            raise InvalidRequestError(f"unknown pipeline input(s) {sorted(unknown)}; inputs are {sorted(spec.inputs)}")
        if spec.inputs and not inputs:
            raise InvalidRequestError(f"no pipeline inputs given; inputs are {sorted(spec.inputs)}")
        params = dict(params or {})
        bad = set(params) - set(spec.stages)
        if bad:
            raise InvalidRequestError(
                f"params for unknown stage(s) {sorted(bad)}; stages are {sorted(spec.stages)}", param="params"
            )
        if deadline is None and spec.default_deadline_s:
            deadline = time.time() + spec.default_deadline_s
        rid = request_id or uuid.uuid4().hex
        # copy input tensors into shared memory before taking the lock (a 64 MiB copy must not
        # stall routing); the slots are released again if the request is not admitted
        encoded: dict[str, Any] = {}
        for port, value in inputs.items():
            edges = self._port_edges[PIPELINE_INPUTS].get(port, [])
            if edges:
                encoded[port] = encode(value, self._pool, len(edges))
        try:
            return self._admit(rid, params, sink, deadline, encoded)
        except BaseException:
            for port, payload in encoded.items():
                for slot in range(len(self._port_edges[PIPELINE_INPUTS][port])):
                    release_all(payload, self._reader, slot)
            raise

    def _admit(self, rid: str, params: dict, sink: Sink, deadline: float | None, encoded: dict[str, Any]) -> str:
        spec = self.spec
        with self._lock:
            if self.closing or self.closed or not self.started:
                raise PipelineClosedError(
                    f"pipeline {spec.name!r} is {'not started' if not self.started else 'closed'}"
                )
            if len(self._requests) >= spec.max_queued_requests:
                self.counts["rejected"] += 1
                raise OverloadedError(
                    f"pipeline {spec.name!r} is overloaded: {len(self._requests)} requests in flight "
                    f"(max_queued_requests={spec.max_queued_requests}); retry later"
                )
            if rid in self._requests:
                raise InvalidRequestError(f"request id {rid!r} is already in flight", param="request_id")
            req = _Request(rid, _safe_sink(sink), params, deadline, open_stages=set(spec.stages))
            self._requests[rid] = req
            if deadline is not None:
                heapq.heappush(self._deadlines, (deadline, rid))
                self._wake()
            for port in spec.inputs:
                edges = self._port_edges[PIPELINE_INPUTS].get(port, [])
                # an input left out closes its consumers' ports without data (optional ports)
                given = port in encoded
                payload = encoded.get(port)
                for slot, idx in enumerate(edges):
                    self._deliver(req, PIPELINE_INPUTS, idx, slot, payload, given, True)
            for stage in self._sources:
                self._send(
                    self._replica_for(req, stage), Deliver(rid, None, None, 0, True, False, self._meta(req, stage))
                )
        return rid

    def abort(self, rid: str) -> None:
        with self._lock:
            req = self._requests.get(rid)
            if req is not None:
                self._finish(req, RequestCancelledError(f"request {rid} was cancelled"), "cancelled")

    def num_requests(self) -> int:
        return len(self._requests)

    # -- routing (lock held) --------------------------------------------------------------------
    def _meta(self, req: _Request, stage: str) -> RequestMeta:
        return RequestMeta(dict(req.params.get(stage) or {}), req.deadline)

    def _replica_for(self, req: _Request, stage: str) -> Replica:
        r = req.replicas.get(stage)
        if r is None:
            reps = [x for x in self.replicas[stage] if not x.dead]
            ready = [x for x in reps if x.ready] or reps or self.replicas[stage]
            r = min(ready, key=lambda x: len(x.requests))
            req.replicas[stage] = r
            r.requests.add(req.rid)
        return r

    def _send(self, r: Replica, msg) -> None:
        if not r.ready:
            r.pending.append(msg)
            return
        try:
            send_msg(r.conn, msg)
        except OSError:
            pass  # the worker died; its sentinel fires and the hub fails its requests

    def _deliver(
        self, req: _Request, src_stage: str, idx: int, slot: int, payload: Any, has_data: bool, last: bool
    ) -> None:
        e = self.spec.edges[idx]
        if e.dst.stage == PIPELINE_OUTPUTS:
            data = decode(payload, self._reader, slot) if has_data else None
            if e.stream is not None:  # each chunk to the caller as it is produced
                if has_data or last:
                    req.sink(OutputChunk(req.rid, e.dst.port, data, last, None, src_stage))
                return
            # a non-streaming output edge delivers the concatenation once the producer finished
            buf = req.out_buffers.setdefault(idx, [])
            if has_data:
                buf.append(data)
            if last:
                del req.out_buffers[idx]
                req.sink(OutputChunk(req.rid, e.dst.port, combine_chunks(buf), True, None, src_stage))
            return
        if req.rid not in self._requests:
            return  # failed while this emission was being routed
        dst = e.dst.stage
        first = dst not in req.replicas
        r = self._replica_for(req, dst)
        if r.dead:
            self._finish(
                req,
                WorkerDiedError(dst, f"replica {r.index} is down and could not be restarted: {r.start_error}"),
                "worker_died",
            )
            return
        if has_data:
            producer = req.replicas.get(src_stage)
            gen = producer.generation if producer is not None else 0
            for ref in iter_refs(payload):
                req.sent_slots.setdefault(dst, []).append((producer, gen, ref.segment, ref.use, slot))
        self._send(
            r, Deliver(req.rid, e.dst.port, payload, slot, last, has_data, self._meta(req, dst) if first else None)
        )

    def _finish(self, req: _Request, error: BaseException | None, outcome: str) -> None:
        """End a request: abort it where it still runs, return permits, tell the caller."""
        self._requests.pop(req.rid, None)
        for stage, r in req.replicas.items():
            if req.rid in r.requests:
                r.requests.discard(req.rid)
                if stage in req.open_stages and error is not None:
                    self._send(r, Abort(req.rid))
        req.open_stages.clear()
        for idx in req.hub_permits:
            self._release_permit(idx)
        req.hub_permits.clear()
        self.counts[outcome] += 1
        req.sink(RequestEnd(req.rid, error))
        self._cond.notify_all()

    def _release_permit(self, idx: int) -> None:
        self._permits[idx].release()
        for r in self.replicas[self.spec.edges[idx].src.stage]:
            if r.ready:
                self._send(r, PermitFreed(idx))

    def _on_emit(self, r: Replica, msg: Emit) -> None:
        stage = r.stage
        port_edges = self._port_edges[stage]
        req = self._requests.get(msg.request_id)
        if req is None or req.replicas.get(stage) is not r or stage not in req.open_stages:
            for port, payload in msg.outputs.items():
                for slot in range(len(port_edges.get(port, ()))):
                    release_all(payload, self._reader, slot)
            return
        if msg.error is not None:
            for port, payload in msg.outputs.items():
                for slot in range(len(port_edges.get(port, ()))):
                    release_all(payload, self._reader, slot)
            if msg.error_kind == "invalid_request":
                self._finish(req, InvalidRequestError(f"stage {stage!r}: {msg.error}", param=msg.param), "invalid")
            else:
                self._finish(req, StageError(stage, msg.error), "error")
            return
        for port, payload in msg.outputs.items():
            for slot, idx in enumerate(port_edges.get(port, ())):
                self._deliver(req, stage, idx, slot, payload, True, msg.finished)
        if msg.progress is not None:
            req.sink(OutputChunk(req.rid, None, None, False, tuple(msg.progress), stage))
        if msg.finished:
            for port, edges in port_edges.items():
                if port not in msg.outputs:
                    for slot, idx in enumerate(edges):
                        self._deliver(req, stage, idx, slot, None, False, True)
            req.open_stages.discard(stage)
            req.sent_slots.pop(stage, None)
            r.requests.discard(req.rid)
            for idx in self._in_edge_idx[stage]:
                if idx in req.hub_permits:
                    req.hub_permits.discard(idx)
                    self._release_permit(idx)
            if not req.open_stages:
                self._finish(req, None, "ok")

    def _on_death(self, r: Replica) -> None:
        # what the worker sent before dying still counts (e.g. a request it just finished)
        try:
            while r.conn is not None and r.conn.poll():
                self._on_message(r, recv_msg(r.conn))
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001
            log.exception("omnistage: reading the last messages of %s failed", r.name)
        proc = r.proc
        proc.join(timeout=1)
        code = proc.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        was_ready = r.ready
        r.ready = False
        r.last_stats = {}  # the dead process's figures no longer describe anything
        try:
            r.conn.close()
        except OSError:
            pass
        r.conn = None
        held = [self._requests[rid] for rid in list(r.requests) if rid in self._requests]
        r.requests.clear()
        self._release_slots_of_dead_reader(r, held)
        for req in held:
            self._finish(
                req,
                WorkerDiedError(
                    r.stage,
                    f"worker process of replica {r.index} (pid {r.pid}) died ({how}) while holding this request",
                ),
                "worker_died",
            )
        self._reconcile_permits(r)
        # its own segments may still be on their way to readers: unlink once every request
        # in flight now has ended
        self._dead_segments.append(
            (f"{self.shm_prefix}-{r.stage}{r.index}g{r.generation}-{proc.pid}-", set(self._requests))
        )
        if self._stopping or self.closing:
            return
        if not was_ready:
            if r.start_error is None:
                r.start_error = f"worker process exited during start-up ({how})"
            if not r.ever_ready:
                self._cond.notify_all()
                return  # initial start failed: wait_ready reports it, no restart loop
            r.restart_failures += 1
            if r.restart_failures > MAX_RESTART_FAILURES:
                r.dead = True
                for msg in r.pending:
                    if isinstance(msg, Deliver) and msg.request_id in self._requests:
                        self._finish(
                            self._requests[msg.request_id],
                            WorkerDiedError(r.stage, f"replica {r.index} cannot be restarted: {r.start_error}"),
                            "worker_died",
                        )
                r.pending.clear()
                return
        r.pending.clear()
        r.generation += 1
        r.restarts += 1
        try:
            self._spawn(r)
        except Exception as exc:  # noqa: BLE001 - e.g. the fork server is gone
            log.exception("omnistage: restarting %s failed", r.name)
            r.dead = True
            r.start_error = f"restart failed: {type(exc).__name__}: {exc}"
        self._cond.notify_all()

    def _release_slots_of_dead_reader(self, r: Replica, held: list[_Request]) -> None:
        """Release the shared-memory slots delivered to a dead replica for requests it had not
        finished: its tensors will never be freed, so their producers would never reuse those
        segments. A slot the worker did release is harmless to release again (the producer
        checks the segment is still in that use)."""
        by_producer: dict[Replica, list[tuple[str, int, int]]] = {}
        for req in held:
            for producer, gen, segment, use, slot in req.sent_slots.pop(r.stage, ()):
                if producer is None:
                    self._pool.force_release(segment, use, slot)
                elif producer.generation == gen and producer.conn is not None:
                    by_producer.setdefault(producer, []).append((segment, use, slot))
                # else: that producer died too; its segments are unlinked with it
        for producer, slots in by_producer.items():
            self._send(producer, ReleaseSlots(slots))

    def _reconcile_permits(self, r: Replica) -> None:
        """A worker reports permits right after taking them (PermitsTaken), and the requests it
        held returned theirs when they failed; a kill between the take and the report would
        still leak one. With no other replica of the stage alive, nobody but the hub touches
        the edge's semaphore now, so its value must be max_inflight minus the permits the hub
        holds: top it up to that."""
        if len(self.replicas[r.stage]) != 1:
            return
        for idx, sem in self._permits.items():
            e = self.spec.edges[idx]
            if e.src.stage != r.stage:
                continue
            held = sum(1 for req in self._requests.values() if idx in req.hub_permits)
            try:
                missing = int(e.max_inflight) - held - sem.get_value()
            except NotImplementedError:  # no sem_getvalue (macOS)
                return
            for _ in range(max(0, missing)):
                sem.release()

    def _reap_dead_segments(self) -> None:
        if not self._dead_segments:
            return
        keep = []
        for prefix, rids in self._dead_segments:
            rids.intersection_update(self._requests.keys())
            if rids:
                keep.append((prefix, rids))
                continue
            cleanup_prefix(prefix.rstrip("-"))
            self._reader.forget(prefix)
            for reps in self.replicas.values():
                for x in reps:
                    if x.ready:
                        self._send(x, ForgetSegments(prefix))
        self._dead_segments = keep

    # -- hub thread -----------------------------------------------------------------------------
    def _hub_loop(self) -> None:
        while True:
            with self._lock:
                if self._stopping and all(
                    r.conn is None or not r.proc.is_alive() for reps in self.replicas.values() for r in reps
                ):
                    return
                by_conn = {}
                by_sentinel = {}
                for reps in self.replicas.values():
                    for r in reps:
                        if r.conn is not None:
                            by_conn[r.conn] = r
                            by_sentinel[r.proc.sentinel] = r
                timeout = 0.5
                if self._deadlines:
                    timeout = max(0.0, min(timeout, self._deadlines[0][0] - time.time()))
            if self._stopping:
                timeout = min(timeout, 0.05)
            try:
                ready = wait(list(by_conn) + list(by_sentinel) + [self._wake_r], timeout)
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
                    r = by_conn[obj]
                    try:
                        while True:
                            msg = recv_msg(obj)
                            with self._lock:
                                try:
                                    self._on_message(r, msg)
                                except Exception:  # noqa: BLE001 - one bad message must not stop routing
                                    log.exception("omnistage: failed to handle %s from %s", type(msg).__name__, r.name)
                            if not obj.poll():
                                break
                    except (EOFError, OSError):
                        dead.append(r)
                else:
                    dead.append(by_sentinel[obj])
            with self._lock:
                for r in dict.fromkeys(dead):
                    if r.conn is None:
                        continue
                    if self._stopping:
                        r.conn.close()
                        r.conn = None  # orderly exit after Shutdown
                    else:
                        try:
                            self._on_death(r)
                        except Exception:  # noqa: BLE001 - the hub must keep routing
                            log.exception("omnistage: handling the death of %s failed", r.name)
                self._expire_deadlines()
                self._reap_dead_segments()

    def _on_message(self, r: Replica, msg) -> None:
        if isinstance(msg, Emit):
            self._on_emit(r, msg)
        elif isinstance(msg, EmitBatch):
            for emit in msg.emits:
                self._on_emit(r, emit)
        elif isinstance(msg, PermitsTaken):
            req = self._requests.get(msg.request_id)
            if req is None or req.replicas.get(r.stage) is not r or r.stage not in req.open_stages:
                for idx in msg.edges:  # the request ended meanwhile
                    self._release_permit(idx)
            else:
                req.hub_permits.update(msg.edges)
        elif isinstance(msg, StatsReply):
            r.last_stats = msg.stats
            r.last_stats["seq"] = msg.seq
            self._cond.notify_all()
        elif isinstance(msg, Ready):
            r.ready = r.ever_ready = True
            r.start_error = None
            r.restart_failures = 0
            r.pid = msg.pid
            pending, r.pending = r.pending, []
            for m in pending:
                self._send(r, m)
            self._cond.notify_all()
        elif isinstance(msg, StartFailed):
            r.start_error = msg.error
            self._cond.notify_all()

    def _expire_deadlines(self) -> None:
        now = time.time()
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, rid = heapq.heappop(self._deadlines)
            req = self._requests.get(rid)
            if req is not None and req.deadline == deadline:
                self._finish(req, DeadlineExceededError(f"request {rid} exceeded its deadline"), "deadline")

    # -- stats ----------------------------------------------------------------------------------
    def query_stats(self, timeout: float = 2.0) -> dict[str, list[dict]]:
        with self._cond:
            if self.closed:
                timeout = 0.0
            self._stats_seq += 1
            seq = self._stats_seq
            asked = []
            for reps in self.replicas.values():
                for r in reps:
                    if r.ready:
                        self._send(r, StatsQuery(seq))
                        asked.append(r)
            end = time.monotonic() + timeout
            while any(r.ready and r.last_stats.get("seq") != seq for r in asked) and time.monotonic() < end:
                self._cond.wait(max(0.0, end - time.monotonic()))
            out = {}
            for stage, reps in self.replicas.items():
                out[stage] = [
                    {
                        "replica": r.index,
                        "ready": r.ready,
                        "restarts": r.restarts,
                        "held_requests": len(r.requests),
                        **{k: v for k, v in r.last_stats.items() if k != "seq"},
                    }
                    for r in reps
                ]
            return out
