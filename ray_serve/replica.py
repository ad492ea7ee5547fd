"""StageReplica: one Serve replica of one stage pool, running the embedded worker's engine loop.

The engine is built and stepped by `runtime.worker.Worker` itself, in a thread of the replica:
the same inbox (Deliver, Abort), the same input assembly (fan-in joins, re-chunking), the same
continuous stepping that batches every request routed to the replica. Only its transport
differs: deliveries arrive as Serve calls instead of pipe messages, and each request's
emissions leave through that request's `open` stream instead of the worker's pipe, as values
in Ray's object store instead of shared-memory references.

Calls, each made by the graph driver (ray_serve/driver.py):
- `open(rid)`: a streaming call; yields this replica's id first (the pin for what follows),
  then lists of `Emit`s until the stage finished the request. Cancelling it aborts the
  request in the engine.
- `deliver(rid, delivers, replica=ID)`: the request's inputs, in order, batched per hop.
- `stats()`: the worker's snapshot (queue depth, batch sizes, engine stats).
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import torch

from omnistage.ray_serve.options import PipelineSource
from omnistage.runtime.messages import Abort, Deliver, Emit, EmitBatch, Ready, Shutdown, StartFailed
from omnistage.runtime.worker import Worker, WorkerConfig
from omnistage.stages.base import Emission


class UnknownRequestError(RuntimeError):
    """A delivery reached a replica that does not hold its request (the one that did died)."""


class _EngineLoop(Worker):
    """The embedded worker with its pipe replaced by a callback per batch of emits."""

    def __init__(self, cfg: WorkerConfig, publish):
        super().__init__(cfg, conn=None)
        self._publish = publish
        self.started = threading.Event()
        self.start_error: str | None = None

    def _read_loop(self) -> None:
        return  # no pipe: the replica's calls put messages in the inbox directly

    def send(self, msg) -> None:
        if isinstance(msg, Emit):
            self._publish([msg])
        elif isinstance(msg, EmitBatch):
            self._publish(msg.emits)
        elif isinstance(msg, StartFailed):
            self.start_error = msg.error
            self.started.set()
        elif isinstance(msg, Ready):
            self.started.set()
        # PermitsTaken never happens (the driver holds edge permits); the rest is pipe upkeep

    def _send_emissions(self, emissions: list[Emission]) -> None:
        emits = []
        for em in emissions:
            outputs = {}
            if em.error is None:
                outputs = {p: _portable(v) for p, v in em.outputs.items() if self.port_edges.get(p)}
            finished = em.finished or em.error is not None
            absent = tuple(em.absent_ports) if em.finished else ()
            emits.append(Emit(em.request_id, outputs, finished, em.error, em.error_kind, em.progress, em.param, absent))
        if not emits:
            return
        self._publish(emits)
        for emit in emits:
            if emit.finished:
                if emit.request_id in self.active or emit.error is not None:
                    self.stats.outcomes["ok" if emit.error is None else "error"] += 1
                self.active.discard(emit.request_id)


def _portable(value: Any) -> Any:
    """A value another node can read: device tensors are copied to the host."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.cpu()
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value):
        return type(value)(_portable(v) for v in value)
    return value


class _RequestStream:
    """One request's emits, handed from the engine thread to the replica's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[list[Emit]] = asyncio.Queue()

    async def next_batch(self) -> list[Emit]:
        batch = await self.queue.get()
        while not self.queue.empty():  # everything produced meanwhile leaves in one message
            batch = batch + self.queue.get_nowait()
        return batch


class StageReplica:
    """The deployment class; app.py wraps it with `serve.deployment` and the pool's options."""

    def __init__(self, source: dict, pipeline: str, stage: str):
        from ray import serve

        spec = PipelineSource.from_dict(source).load(pipeline)
        pool = spec.stages[stage].pool
        torch.set_num_threads(max(1, int(pool.threads)))
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        # Ray hands a GPU replica its device as the only visible one
        device = "cuda:0" if any(d.startswith("cuda") for d in pool.devices) else "cpu"
        cfg = WorkerConfig(spec, stage, _rank(context), device, f"omnistage-ray-{os.getpid()}")
        self._streams: dict[str, _RequestStream] = {}
        self._lock = threading.Lock()
        self._outbox: list[list[Emit]] = []
        self.worker = _EngineLoop(cfg, self._publish)
        self._thread = threading.Thread(target=self.worker.run, name=f"omnistage-{stage}", daemon=True)
        self._thread.start()
        self.worker.started.wait()
        if self.worker.start_error is not None:
            raise RuntimeError(f"stage {stage!r}: {self.worker.start_error}")

    # -- engine thread -> event loop ---------------------------------------------------------
    def _publish(self, emits: list[Emit]) -> None:
        loops = {s.loop for e in emits if (s := self._streams.get(e.request_id)) is not None}
        if not loops:
            return  # requests that ended here (cancelled): nobody reads these
        with self._lock:
            self._outbox.append(emits)
            if len(self._outbox) > 1:
                return  # a hand-over is already scheduled and takes these too
        for loop in loops:
            loop.call_soon_threadsafe(self._hand_over)

    def _hand_over(self) -> None:
        with self._lock:
            batches, self._outbox = self._outbox, []
        by_request: dict[str, list[Emit]] = {}
        for emits in batches:
            for e in emits:
                by_request.setdefault(e.request_id, []).append(e)
        for rid, emits in by_request.items():
            stream = self._streams.get(rid)
            if stream is not None:
                stream.queue.put_nowait(emits)

    # -- calls ---------------------------------------------------------------------------------
    async def open(self, rid: str):
        stream = self._streams[rid] = _RequestStream(asyncio.get_running_loop())
        finished = False
        try:
            yield self.replica_id
            while not finished:
                batch = await stream.next_batch()
                finished = any(e.finished for e in batch)
                yield batch
        finally:
            self._streams.pop(rid, None)
            if not finished:  # cancelled by the driver, or the caller went away
                self.worker.inbox.put(Abort(rid))

    async def deliver(self, rid: str, delivers: list[Deliver], replica: str | None = None) -> None:
        if rid not in self._streams:
            raise UnknownRequestError(f"replica {self.replica_id} does not hold request {rid}")
        for msg in delivers:
            self.worker.inbox.put(msg)

    def stats(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, **self.worker.snapshot()}

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the engine loop stopped")

    def __del__(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None and self._thread.is_alive():
            worker.inbox.put(Shutdown())
            self._thread.join(timeout=10)


def _rank(context: Any) -> int:
    rank = getattr(context, "rank", 0)
    return int(getattr(rank, "rank", rank) or 0)
