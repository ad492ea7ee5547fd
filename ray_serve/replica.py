"""StageReplica: one Serve replica of one stage pool, running the embedded worker's engine loop.

The engine is built and stepped by `runtime.worker.Worker` itself, in a child process of the
replica (ray_serve/engine_process.py): the same inbox (Deliver, Abort), the same input assembly
(fan-in joins, re-chunking), the same continuous stepping that batches every request routed to
it. Only its transport differs: deliveries arrive as Serve calls and go down the worker's
pipe, and emissions leave through one stream per graph driver, as values in Ray's object
store. If the engine process dies, the replica ends itself so that Serve replaces both.

Calls, each made by a graph driver (ray_serve/driver.py) that names itself by a channel id:
- `open(channel, requests)`: takes requests, each `(rid, its first deliveries)` (Serve picks
  the replica for the call); answers this replica's id, which pins the calls below to it.
- `listen(channel, replica=ID)`: a streaming call, one per driver and replica; yields lists
  of `Emit`s of every request of that driver, all a step produced in one item, pickled. When it ends
  (the driver went away), the driver's requests are aborted here.
- `deliver(delivers, replica=ID)` and `abort(rid, replica=ID)`: later inputs (several
  requests' in one call) and cancellation.
- `stats()`: the worker's snapshot (queue depth, batch sizes, engine stats).
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import threading
from typing import Any

from omnistage.ray_serve.engine_process import EngineProcess
from omnistage.ray_serve.options import BackendOptions
from omnistage.ray_serve.scaling import METRIC
from omnistage.runtime.messages import Abort, Deliver, Emit

log = logging.getLogger(__name__)

ENDED_KEEP = 4096


class _Channel:
    """One driver's emits on this replica, handed from the relay thread to the event loop.

    Each item the stream yields costs this process and the driver's a fixed share of Serve's
    per-item work, whatever it carries (CPU the engines on the same cores lose). So under a
    steady flow items leave at most every `interval` seconds, each with all the steps made
    meanwhile; the first item after a quiet spell, and one that ends a request, leave at once
    (no latency added to a first chunk or to a request's end)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float):
        self.loop = loop
        self.interval = interval
        self.queue: asyncio.Queue[list[Emit]] = asyncio.Queue()
        self.requests: set[str] = set()
        self.last = float("-inf")

    async def next_batch(self) -> list[Emit]:
        batch = await self.queue.get()
        wait = self.last + self.interval - self.loop.time()
        if wait > 0 and not any(e.finished for e in batch):  # a request's end is not held back
            await asyncio.sleep(wait)
        while not self.queue.empty():  # everything produced meanwhile leaves in one item
            batch = batch + self.queue.get_nowait()
        self.last = self.loop.time()
        return batch


class StageReplica:
    """The deployment class; app.py wraps it with `serve.deployment` and the pool's options."""

    def __init__(self, source: dict, pipeline: str, stage: str, options: dict | None = None):
        from ray import serve

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self._relay_interval = BackendOptions.from_dict(options).relay_interval_ms / 1000.0
        self._channels: dict[str, _Channel] = {}
        self._owner: dict[str, _Channel] = {}  # request id -> its driver's channel
        # requests that ended here lately (finished, aborted): inputs still on their way to them
        # are dropped (a stage may finish before its streaming inputs close)
        self._ended: dict[str, None] = {}
        self._lock = threading.Lock()
        self._outbox: list[Emit] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # the engine process loads the pipeline itself: this process never imports torch
        self.engine = EngineProcess(source, pipeline, stage, _rank(context), self._publish, self._engine_exited)
        try:
            self.engine.wait_started()
        except RuntimeError as exc:
            self.engine.close()
            raise RuntimeError(f"stage {stage!r}: {exc}") from None

    # -- engine process -> event loop --------------------------------------------------------
    def _engine_exited(self) -> None:
        """The engine process died (killed, out of memory): its requests are lost, so this
        replica ends too; the drivers fail those requests and Serve starts a new replica."""
        log.error("the engine process of this replica exited (code %s)", self.engine.exit_code())
        os._exit(1)

    def _publish(self, emits: list[Emit]) -> None:
        if self._loop is None:
            return  # no request was ever opened here
        with self._lock:
            first = not self._outbox
            self._outbox.extend(emits)
        if first:  # else a hand-over is already scheduled and takes these too
            self._loop.call_soon_threadsafe(self._hand_over)

    def _hand_over(self) -> None:
        with self._lock:
            emits, self._outbox = self._outbox, []
        by_channel: dict[_Channel, list[Emit]] = {}
        for e in emits:
            channel = self._owner.get(e.request_id)
            if channel is None:
                continue  # aborted here: nobody reads it
            by_channel.setdefault(channel, []).append(e)
            if e.finished:
                del self._owner[e.request_id]
                channel.requests.discard(e.request_id)
                self._end(e.request_id)
        for channel, batch in by_channel.items():
            channel.queue.put_nowait(batch)

    def _channel(self, name: str) -> _Channel:
        self._loop = asyncio.get_running_loop()
        channel = self._channels.get(name)
        if channel is None:
            channel = self._channels[name] = _Channel(self._loop, self._relay_interval)
        return channel

    # -- calls ---------------------------------------------------------------------------------
    async def open(self, channel: str, requests: list[tuple[str, list[Deliver]]]) -> str:
        ch = self._channel(channel)
        for rid, delivers in requests:
            ch.requests.add(rid)
            self._owner[rid] = ch
            for msg in delivers:
                self.engine.send(msg)
        return self.replica_id

    async def listen(self, channel: str, replica: str | None = None):
        if replica is not None and replica != self.replica_id:
            # routed here because the pinned replica is gone: its requests are not here
            raise RuntimeError(f"replica {replica} is gone (this is {self.replica_id})")
        ch = self._channel(channel)
        try:
            while True:
                # bytes cross Ray without its serializer's per-object work: 360 vs 70 us for 128
                # token emits, 25 vs 6 ms for an emit holding a 4 MiB tensor (pickle's time)
                yield pickle.dumps(await ch.next_batch(), protocol=pickle.HIGHEST_PROTOCOL)
        finally:  # the driver is gone (or cancelled the stream): its requests end here
            self._channels.pop(channel, None)
            for rid in ch.requests:
                self._owner.pop(rid, None)
                self._end(rid)
                self.engine.send(Abort(rid))

    async def deliver(self, delivers: list[Deliver], replica: str | None = None) -> list[str]:
        """Queue the deliveries; answers the requests this replica never held (the replica
        that did died and Serve routed the call here): those fail, the others go on."""
        for msg in delivers:
            if msg.request_id in self._owner:
                self.engine.send(msg)
        return sorted({m.request_id for m in delivers if m.request_id not in self._owner} - self._ended.keys())

    async def abort(self, rid: str, replica: str | None = None) -> None:
        ch = self._owner.pop(rid, None)
        if ch is not None:
            ch.requests.discard(rid)
            self._end(rid)
            self.engine.send(Abort(rid))

    def _end(self, rid: str) -> None:
        self._ended[rid] = None
        if len(self._ended) > ENDED_KEEP:
            del self._ended[next(iter(self._ended))]

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What ray_serve/scaling.py's policy scales on: the requests this replica holds."""
        return {METRIC: float(len(self._owner))}

    async def stats(self) -> dict[str, Any]:
        """The worker's snapshot (its `pid` is the engine process's) and this replica's id and pid."""
        return {**await self.engine.stats(), "replica_id": self.replica_id, "replica_pid": os.getpid()}

    def check_health(self) -> None:
        if not self.engine.alive():
            raise RuntimeError("the engine process stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def _rank(context: Any) -> int:
    rank = getattr(context, "rank", 0)
    return int(getattr(rank, "rank", rank) or 0)
