"""EngineProcess: a stage replica's engine, in a child process of the replica.

A Serve replica's process is busy besides the engine: its event loop answers Serve's calls and
relays emits, and Ray's own threads run beside it. An engine stepped by a thread of that
process shares the interpreter lock with all of it, and a small model's step (mostly Python)
ran about twice as long there as in an embedded worker (docs/scale-out.md). So the replica
starts the embedded worker's process entry point (`runtime.worker.worker_main`, the same
signal, thread and allocator settings) with a pipe, and only relays: messages to the worker
(Deliver, Abort, Shutdown, StatsQuery) down the pipe, its Ready/StartFailed/Emit/StatsReply
back to callbacks.

Emitted values travel in the pipe by value (the runtime's shared-memory segments are not
used: the next hop is Ray's object store, which copies them anyway), device tensors copied
to the host first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

import torch

from omnistage.runtime.messages import (
    Emit,
    EmitBatch,
    Ready,
    Shutdown,
    StartFailed,
    StatsQuery,
    StatsReply,
    recv_msg,
    send_msg,
)
from omnistage.runtime.replicas import without_main_reimport
from omnistage.runtime.worker import Worker, WorkerConfig, worker_main
from omnistage.stages.base import Emission

STOP_JOIN_S = 10.0


class PortableWorker(Worker):
    """The embedded worker, its outputs sent by value instead of as shared-memory references.
    Edge permits and streaming credit are the graph driver's business (ray_serve/driver.py)."""

    def _send_emissions(self, emissions: list[Emission]) -> None:
        emits = []
        for em in emissions:
            outputs = {}
            if em.error is None:
                outputs = {p: portable(v) for p, v in em.outputs.items() if self.port_edges.get(p)}
            finished = em.finished or em.error is not None
            absent = tuple(em.absent_ports) if em.finished else ()
            emits.append(Emit(em.request_id, outputs, finished, em.error, em.error_kind, em.progress, em.param, absent))
        if not emits:
            return
        self.send(emits[0] if len(emits) == 1 else EmitBatch(emits))
        for emit in emits:
            if emit.finished:
                if emit.request_id in self.active or emit.error is not None:
                    self.stats.outcomes["ok" if emit.error is None else "error"] += 1
                self.active.discard(emit.request_id)


def portable(value: Any) -> Any:
    """A value another node can read: device tensors are copied to the host."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.cpu()
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value):
        return type(value)(portable(v) for v in value)
    return value


class EngineProcess:
    """Starts the worker process, waits for its engine, relays messages both ways.

    `on_emits(list[Emit])` is called on the reader thread; `on_exit()` there too when the
    process goes away without having been asked to (it crashed or was killed)."""

    def __init__(self, cfg: WorkerConfig, on_emits: Callable[[list[Emit]], None], on_exit: Callable[[], None]):
        self._on_emits = on_emits
        self._on_exit = on_exit
        self._started = threading.Event()
        self._start_error: str | None = None
        self._stopping = False
        self._send_lock = threading.Lock()
        self._seq = itertools.count()
        self._stats: dict[int, concurrent.futures.Future] = {}
        # spawn, not fork: a forked child gets gRPC's threads back (Ray's fork handlers start
        # them again), and with them the slow steps this process exists to avoid
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        name = f"omnistage:{cfg.spec.name}:{cfg.stage}"
        self.proc = ctx.Process(target=worker_main, args=(cfg, child_conn, PortableWorker), name=name, daemon=True)
        with without_main_reimport():  # a Ray worker's __main__ is Ray's own script
            self.proc.start()
        child_conn.close()
        self._reader = threading.Thread(target=self._read_loop, name=f"omnistage-relay-{cfg.stage}", daemon=True)
        self._reader.start()

    def wait_started(self) -> None:
        """Block until the engine is built; raise RuntimeError with its error if it failed."""
        self._started.wait()
        if self._start_error is not None:
            raise RuntimeError(self._start_error)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.is_alive() and self._reader.is_alive()

    def send(self, msg) -> None:
        with self._send_lock:
            send_msg(self._conn, msg)

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        seq = next(self._seq)
        future = self._stats[seq] = concurrent.futures.Future()
        try:
            self.send(StatsQuery(seq))
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        finally:
            self._stats.pop(seq, None)

    def _read_loop(self) -> None:
        try:
            while True:
                msg = recv_msg(self._conn)
                if isinstance(msg, Emit):
                    self._on_emits([msg])
                elif isinstance(msg, EmitBatch):
                    self._on_emits(msg.emits)
                elif isinstance(msg, StatsReply):
                    future = self._stats.get(msg.seq)
                    if future is not None and not future.done():
                        future.set_result(msg.stats)
                elif isinstance(msg, Ready):
                    self._started.set()
                elif isinstance(msg, StartFailed):
                    self._start_error = msg.error
                    self._started.set()
                # the rest (memory reports, consumed-chunk counts) is the embedded hub's upkeep
        except (EOFError, OSError):
            pass
        if not self._started.is_set():
            self.proc.join(1)
            self._start_error = f"the engine process exited (code {self.proc.exitcode}) while starting"
            self._started.set()
        elif self._start_error is None and not self._stopping:
            self._on_exit()

    def close(self) -> None:
        """Ask the worker to finish (it drains its inbox and closes the engine), then reap it."""
        self._stopping = True
        try:
            self.send(Shutdown())
        except OSError:
            pass
        self.proc.join(STOP_JOIN_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self._conn.close()
