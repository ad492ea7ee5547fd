"""A stage worker: one process hosting one replica of one stage and running its engine loop.

Loop: drain the inbox (deliveries, aborts, stats queries) -> engine.add/feed/abort -> engine.step()
when it has work -> send emissions to the orchestrator. Idle, it blocks on the inbox until the engine's
next wakeup (no busy spin); a reader thread keeps the pipe drained for the orchestrator.

Per-edge backpressure: a request is added to the engine only once the worker holds an
in-flight permit for each out-edge with `max_inflight`; the orchestrator returns the permit
when the consumer stage finishes the request (or the request ends). Per-request credit on
streaming edges (runtime/credit.py): a request whose consumer is behind is paused in the
engine; credit for the chunks this worker's engine took goes back after its next step.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any

import setproctitle
import torch

from omnistage.errors import StageConfigError, one_line_error
from omnistage.graph.spec import PipelineSpec
from omnistage.runtime.allocator import apply_allocator_defaults
from omnistage.runtime.assembler import InputAssembler
from omnistage.runtime.cpu_affinity import pin_worker
from omnistage.runtime.credit import ReturnCredit, SendCredit
from omnistage.runtime.messages import (
    Abort,
    Consumed,
    Credit,
    Deliver,
    Emit,
    EmitBatch,
    ForgetSegments,
    PermitFreed,
    PermitsTaken,
    Ready,
    ReleaseSlots,
    Shutdown,
    StartFailed,
    StatsQuery,
    StatsReply,
    recv_msg,
    send_msg,
)
from omnistage.runtime.shm import (
    SegmentPool,
    SegmentReader,
    cleanup_prefix,
    decode,
    encode,
    owner_pid,
    process_gone,
    worker_pool_prefix,
)
from omnistage.runtime.step_stats import StepStats
from omnistage.runtime.watchdog import MemoryWatch
from omnistage.stages.base import Emission, StageContext, StageEngine
from omnistage.stages.contracts import error_emission

STEP_LOG_KEEP = 64
PERMIT_POLL_S = 0.05  # fallback only: the orchestrator sends PermitFreed when it returns one
ENGINE_STATS_EVERY_S = 0.1
DRAIN_MAX = 512


@dataclass
class WorkerConfig:
    spec: PipelineSpec
    stage: str
    replica: int
    device: str
    shm_prefix: str
    # spec.edges index -> multiprocessing semaphore, for this stage's out-edges with max_inflight
    permits: dict[int, Any] = field(default_factory=dict)
    generation: int = 0
    step_clock: Any = None  # runtime.watchdog.StepClock: stamped around every engine step
    stream_credit: bool = False  # per-request credit on streaming edges (runtime/credit.py)


def process_title(cfg: WorkerConfig) -> str:
    """`omnistage: <pipeline>/<stage>#<replica>`, the worker's name in process listings."""
    return f"omnistage: {cfg.spec.name}/{cfg.stage}#{cfg.replica}"


def build_engine(cfg: WorkerConfig) -> StageEngine:
    from omnistage.stages.registry import get_stage_class

    st = cfg.spec.stages[cfg.stage]
    pin_worker(st.pool.cpus, f"stage {cfg.stage!r} replica {cfg.replica}")
    device = torch.device(cfg.device)
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= n:
            raise RuntimeError(
                f"stage {cfg.stage!r} replica {cfg.replica}: device {cfg.device} is not available "
                f"(this machine has {n} CUDA device{'s' if n != 1 else ''})"
            )
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise RuntimeError(f"stage {cfg.stage!r}: unsupported device {cfg.device!r}")
    model_path = None
    if st.model is not None:
        from omnistage.models.recipes import resolve_model

        model_path = str(resolve_model(st.model.source, st.model.subfolder))
    ctx = StageContext(
        stage_name=cfg.stage,
        kind=st.kind,
        model_path=model_path,
        model_subfolder=st.model.subfolder if st.model else None,
        model_prefix=st.model.prefix if st.model else None,
        device=device,
        dtype=getattr(torch, st.pool.dtype),
        batching=st.batching,
        params=dict(st.params or {}),
        replica_index=cfg.replica,
        memory_bytes=st.pool.memory_bytes,
    )
    # weights a factory initialises at random are the same in every replica, on every backend
    # and in every run: the generator starts from the stage's own seed, not from whatever the
    # process did before (a Ray replica's interpreter differs from a forked embedded worker).
    # Then it is reseeded at random: an unseeded request samples anew in every replica and run.
    torch.manual_seed(stage_seed(cfg.spec.name, cfg.stage))
    engine = get_stage_class(st.kind)(ctx)
    torch.seed()
    return engine


def stage_seed(pipeline: str, stage: str) -> int:
    return zlib.crc32(f"{pipeline}/{stage}".encode())


class Worker:
    def __init__(self, cfg: WorkerConfig, conn):
        self.cfg = cfg
        self.conn = conn
        self.spec = cfg.spec
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.pool = SegmentPool(worker_pool_prefix(cfg.shm_prefix, cfg.stage, cfg.replica, cfg.generation))
        self.reader = SegmentReader()
        self.port_edges = self.spec.out_edge_ids_by_port(cfg.stage)
        self.assembler = InputAssembler(
            {e.dst.port: e.stream for e in self.spec.in_edges(cfg.stage)}, self.spec.stages[cfg.stage].request_defaults
        )
        self.permit_edges = sorted(cfg.permits)
        self.send_credit = SendCredit(self.spec, cfg.stage, cfg.stream_credit)  # runtime/credit.py
        self.return_credit = ReturnCredit(self.spec, cfg.stage, cfg.stream_credit)
        self.engine: StageEngine | None = None
        self.active: set[str] = set()  # added to the engine, not finished
        self.waiting_permits: dict[str, list[tuple]] = {}  # rid -> deferred actions (FIFO)
        self.stats = StepStats()
        self.running = True
        self.send_lock = threading.Lock()
        self.engine_stats: dict[str, Any] = {}
        self.engine_stats_at = 0.0
        self.stats_dirty = True
        self.memory = MemoryWatch(self.spec.stages[cfg.stage].pool.max_rss_bytes)

    # -- transport -------------------------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while True:
                msg = recv_msg(self.conn)
                if isinstance(msg, Shutdown) and self.engine is None:
                    # still building the engine (maybe for minutes): nothing to drain or
                    # unlink yet, so leave now instead of after the build
                    os._exit(0)
                if isinstance(msg, ReleaseSlots):
                    # a reader of our segments died: the orchestrator frees the slots it held
                    # (the pool checks each segment is still in the use the slot belongs to)
                    for segment, use, slot in msg.slots:
                        self.pool.force_release(segment, use, slot)
                elif isinstance(msg, ForgetSegments):
                    self.reader.forget(msg.prefix)
                elif isinstance(msg, StatsQuery):
                    # answered off the engine thread so a long step does not delay it, and off
                    # this thread so the inbox keeps draining while the reply waits to be sent
                    threading.Thread(target=self._reply_stats, args=(msg.seq,), daemon=True).start()
                else:
                    self.inbox.put(msg)
        except (EOFError, OSError):
            self.inbox.put(None)  # the orchestrator is gone

    def _reply_stats(self, seq: int) -> None:
        try:
            self.send(StatsReply(seq, self.snapshot()))
        except OSError:
            pass

    def send(self, msg) -> None:
        with self.send_lock:
            send_msg(self.conn, msg)

    def _publish_engine_stats(self) -> None:
        """engine.stats() is read on the engine's own thread; the reader thread replies with
        the latest copy (refreshed before idling and at most every ENGINE_STATS_EVERY_S)."""
        try:
            stats = dict(self.engine.stats())
            stats.setdefault("engine_requests", float(self.engine.num_requests()))
        except Exception:  # noqa: BLE001
            stats = {}
        self.engine_stats = stats
        self.engine_stats_at = time.monotonic()
        self.stats_dirty = False

    # -- main ------------------------------------------------------------------------------
    def run(self) -> None:
        threading.Thread(target=self._read_loop, name="omnistage-inbox", daemon=True).start()
        try:
            self.engine = build_engine(self.cfg)
        except BaseException as exc:  # noqa: BLE001 - report any start-up failure
            trace = "" if isinstance(exc, StageConfigError) else traceback.format_exc(limit=6)
            self.send(StartFailed(one_line_error(exc), trace))
            return
        # What exists now (imported modules, the model's Python objects) lives as long as the
        # worker: frozen, it is no longer scanned by full collections, which otherwise pause
        # the engine for a long scan of the model's objects every few hundred steps.
        gc.collect()
        gc.freeze()
        self._publish_engine_stats()
        self.send(Ready(os.getpid()))
        try:
            self._loop()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the orchestrator is gone: clean up below, quietly
        finally:
            self._shutdown()

    def _loop(self) -> None:
        engine = self.engine
        while self.running:
            if engine.has_work():
                timeout = 0.0
                if time.monotonic() - self.engine_stats_at > ENGINE_STATS_EVERY_S:
                    self._publish_engine_stats()
            else:
                timeout = engine.next_wakeup()
                if self.waiting_permits:
                    timeout = PERMIT_POLL_S if timeout is None else min(timeout, PERMIT_POLL_S)
                timeout = self.memory.bound_wait(timeout)
                if self.stats_dirty:
                    self._publish_engine_stats()
            self._drain(timeout)
            if self.waiting_permits:
                self._admit_waiting()
            if self.running and engine.has_work():
                self._step()
            grants = self.return_credit.take_grants(engine.paused)  # the engine worked on them
            if grants:
                self.send(Consumed(grants))
            self.memory.check(self.send)

    def _drain(self, timeout: float | None) -> None:
        try:
            msg = self.inbox.get(timeout=timeout) if timeout != 0.0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        self._handle(msg)
        for _ in range(DRAIN_MAX - 1):  # bounded, so a flood of input never starves step()
            if not self.running:
                return
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(msg)

    def _handle(self, msg) -> None:
        self.stats_dirty = True
        if isinstance(msg, Deliver):
            try:
                data = decode(msg.payload, self.reader, msg.slot) if msg.has_data else None
                actions = self.assembler.deliver(msg.request_id, msg.port, data, msg.has_data, msg.last, msg.meta)
            except Exception as exc:  # noqa: BLE001 - bad input for this request only
                self._fail(msg.request_id, exc)
                return
            for action in actions:
                self._apply(action)
            if msg.has_data:
                self.return_credit.took(msg.request_id, msg.port, msg.payload)
        elif isinstance(msg, Credit):
            for rid, idx, n in msg.grants:
                if self.send_credit.granted(rid, idx, n):
                    self.engine.resume(rid)
        elif isinstance(msg, Abort):
            self._abort(msg.request_id)
        elif isinstance(msg, PermitFreed):
            pass  # the loop retries waiting admissions right after draining
        elif isinstance(msg, Shutdown) or msg is None:
            self.running = False

    def _apply(self, action: tuple, permitted: bool = False) -> None:
        rid = action[1].request_id if action[0] == "add" else action[1]
        if rid in self.waiting_permits:
            self.waiting_permits[rid].append(action)
            return
        if action[0] == "add" and self.permit_edges and not permitted and not self._take_permits(rid):
            self.waiting_permits[rid] = [action]
            return
        engine = self.engine
        try:
            if action[0] == "add":
                engine.add(action[1])
                self.active.add(rid)
            elif rid in self.active:
                engine.feed(rid, action[2], action[3], action[4])
        except Exception as exc:  # noqa: BLE001 - the engine rejected this request only
            self._fail(rid, exc)

    def _take_permits(self, rid: str) -> bool:
        got = []
        for idx in self.permit_edges:
            if self.cfg.permits[idx].acquire(block=False):
                got.append(idx)
            else:
                for g in got:
                    self.cfg.permits[g].release()
                return False
        # reported at once: from here on the orchestrator owns these permits and returns them,
        # also when this process dies before its first emission for the request
        self.send(PermitsTaken(rid, tuple(got)))
        return True

    def _admit_waiting(self) -> None:
        for rid in list(self.waiting_permits):
            if not self._take_permits(rid):
                return  # FIFO: later requests wait behind the first
            for action in self.waiting_permits.pop(rid):
                self._apply(action, permitted=True)

    def _drop_credit(self, rid: str) -> None:
        grants = self.return_credit.release(rid)
        if grants:
            self.send(Consumed(grants))
        if self.send_credit.drop(rid):
            self.engine.resume(rid)

    def _abort(self, rid: str) -> None:
        self.assembler.drop(rid)
        self._drop_credit(rid)
        self.waiting_permits.pop(rid, None)
        if rid in self.active:
            self.active.discard(rid)
            self.stats.outcomes["aborted"] += 1
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                traceback.print_exc()

    def _fail(self, rid: str, exc: BaseException) -> None:
        self.assembler.drop(rid)
        self.waiting_permits.pop(rid, None)
        if rid in self.active:
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                pass
        self._send_emissions([error_emission(rid, exc)])

    def _step(self) -> None:
        engine = self.engine
        n_log = len(engine.step_log)
        t0 = time.perf_counter()
        clock = self.cfg.step_clock
        if clock is not None:
            clock.begin()  # the hub's watchdog kills a step that never returns
        try:
            emissions = engine.step()
        except Exception as exc:  # noqa: BLE001 - an engine bug fails what it held, not the worker
            traceback.print_exc()
            for rid in list(self.active):
                self._fail(rid, RuntimeError(f"engine step failed: {type(exc).__name__}: {exc}"))
            return
        finally:
            if clock is not None:
                clock.end()
        ms = (time.perf_counter() - t0) * 1000.0
        self.stats_dirty = True
        log = engine.step_log
        if len(log) > n_log:
            batch = log[-1].batch_size
        else:
            batch = len({e.request_id for e in emissions})
        if len(log) > 2 * STEP_LOG_KEEP:
            del log[:-STEP_LOG_KEEP]
        self.stats.record_step(batch, ms)
        if emissions:
            self._send_emissions(emissions)

    def _encode_output(self, value: Any, readers: int) -> Any:
        """An output as it travels to the hub: shared-memory references for `readers` consumers."""
        return encode(value, self.pool, readers)

    def _send_emissions(self, emissions: list[Emission]) -> None:
        emits = []
        for em in emissions:
            outputs = {}
            if em.error is None:
                for port, value in em.outputs.items():
                    edges = self.port_edges.get(port)
                    if edges:
                        outputs[port] = self._encode_output(value, len(edges))
            finished = em.finished or em.error is not None
            absent = tuple(em.absent_ports) if em.finished else ()
            emits.append(Emit(em.request_id, outputs, finished, em.error, em.error_kind, em.progress, em.param, absent))
        if not emits:
            return
        # counted before the send: a stats query answered after the caller has its result (off
        # this thread) sees that request's outcome
        for emit in emits:
            if emit.finished:
                if emit.request_id in self.active or emit.error is not None:
                    self.stats.outcomes["ok" if emit.error is None else "error"] += 1
                self.active.discard(emit.request_id)
        self.send(emits[0] if len(emits) == 1 else EmitBatch(emits))
        for emit in emits:
            if self.send_credit.on_emit(emit.request_id, emit.outputs, emit.finished, self.port_edges):
                self.engine.pause(emit.request_id)  # its consumer is behind: the others go on
            if emit.finished:
                self._drop_credit(emit.request_id)

    def snapshot(self) -> dict[str, Any]:
        for _ in range(5):
            try:
                return self._snapshot()
            except RuntimeError:  # a container changed under the reader thread: try again
                time.sleep(0.001)
        return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        s = self.stats
        steps = sorted(list(s.step_ms))
        return {
            "pid": os.getpid(),
            "queue_depth": self.assembler.num_waiting() + len(self.waiting_permits),
            "inflight": len(self.active),
            "batch_size_last": s.batch_size_last,
            "step_ms_p50": steps[len(steps) // 2] if steps else 0.0,
            "steps": s.steps,
            "batch_hist": list(s.batch_hist),
            "batch_sum": s.batch_sum,
            "step_hist": list(s.step_hist),
            "step_ms_sum": s.step_ms_sum,
            "outcomes": dict(s.outcomes),
            "credit_outstanding": self.send_credit.outstanding(),  # chunks sent, not yet consumed
            "paused": len(self.send_credit.blocked),
            "gc_frozen_objects": gc.get_freeze_count(),
            "engine": self.engine_stats,
        }

    def _shutdown(self) -> None:
        try:
            if self.engine is not None:
                self.engine.close()
        finally:
            self.reader.close()
            # unlinking is safe even while readers still map them, and covers a parent that
            # died without cleaning up
            self.pool.close(unlink=True)
            owner = owner_pid(self.cfg.shm_prefix)
            if owner is not None and process_gone(owner):
                # killed without its close() (SIGTERM's default action, SIGKILL): its own
                # segments (the callers' inputs) would outlive it, so the workers remove them
                cleanup_prefix(self.cfg.shm_prefix)


def worker_main(cfg: WorkerConfig, conn, worker_cls: type[Worker] = Worker) -> None:
    """Process entry point (`worker_cls`: ray_serve's replicas run a Worker with another transport)."""
    # the parent decides when workers stop (SIGTERM to the process group drains in-flight
    # work through the parent); a parent that disappears closes the pipe and ends the worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # what `ps` and `top` show for this worker; SPT_NOENV keeps /proc/<pid>/environ intact
    # (the title then fits in the fork server's long command line instead of growing into it)
    os.environ["SPT_NOENV"] = "1"
    setproctitle.setproctitle(process_title(cfg))
    # Libraries create multiprocessing locks (tqdm does on its first bar); under the start
    # method inherited from the fork server those are named /dev/shm/sem.mp-* files that only
    # a clean exit unlinks, so a killed worker would leave one behind per restart. A "fork"
    # default makes them anonymous. Workers start no processes of their own.
    multiprocessing.set_start_method("fork", force=True)
    apply_allocator_defaults()  # before the engine allocates anything
    threads = max(1, int(cfg.spec.stages[cfg.stage].pool.threads))
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set in this process
        torch.set_num_interop_threads(1)
    worker_cls(cfg, conn).run()
    conn.close()
