"""The driver's side of the Serve calls: edge permits, one link per replica, one call per
request and stage.

- DriverPermits: the `EdgePermits` surface the Router uses, as counters the driver's loop
  waits on (a producer stage takes its out-edges' permits before it takes a request, as the
  embedded worker does before adding it to its engine).
- ReplicaLink: what the driver holds per replica it uses: the replica's `listen` stream (the
  emits of all the driver's requests there, a step's worth per item) and its deliveries,
  batched across requests (one `deliver` call in flight; what arrives meanwhile leaves
  together in the next). A link that fails fails the requests it carries, and only those.
- StageOpener: the `open` calls of one stage. Requests that arrive together (in one turn of
  the driver's loop) open together, OPEN_BATCH to a call (Serve picks one replica for the
  call, which answers its id); the calls of a burst leave at once. A Serve call costs the
  driver and the replica a few milliseconds of CPU whatever it carries, so 32 requests
  opened one call each kept a burst's last request out of the engine for ~100 ms on two
  cores; the cap per call keeps a burst spread over several replicas, and a call that hangs
  holds only its own requests.
- StageCall: one request at one stage: takes the permits, opens the request through the
  stage's opener with the deliveries that arrived so far, then hands everything to that
  replica's link. Cancelling it aborts the request on the replica.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
from collections.abc import Callable
from typing import Any

from omnistage.graph.spec import PipelineSpec
from omnistage.runtime.messages import Deliver, Emit
from omnistage.runtime.replicas import Replica

OPEN_BATCH = 8  # requests per `open` call


class DriverPermits:
    """The `EdgePermits` surface the Router uses, over counters the driver's loop waits on."""

    def __init__(self, spec: PipelineSpec, lock: threading.RLock):
        self.spec = spec
        self.lock = lock
        self.free = {
            i: int(e.max_inflight) for i, e in enumerate(spec.edges) if e.max_inflight and e.src.stage in spec.stages
        }
        self.loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[asyncio.Future] = []

    def of_producer(self, stage: str) -> tuple[int, ...]:
        return tuple(i for i in self.spec.out_edge_ids(stage) if i in self.free)

    async def take(self, stage: str) -> tuple[int, ...]:
        edges = self.of_producer(stage)
        while True:
            with self.lock:
                if all(self.free[i] > 0 for i in edges):
                    for i in edges:
                        self.free[i] -= 1
                    return edges
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
            await waiter

    def release(self, idx: int) -> str:
        with self.lock:
            self.free[idx] += 1
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._wake)
        return self.spec.edges[idx].src.stage

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)


class ReplicaLink:
    def __init__(
        self,
        stage: str,
        pin: str,
        handle: Any,
        channel: str,
        on_emits: Callable[[ReplicaLink, list[Emit]], None],
        on_lost: Callable[[ReplicaLink, list[str], BaseException], None],
    ):
        self.stage = stage
        self.pin = pin
        self.handle = handle
        self.on_emits = on_emits
        self.on_lost = on_lost
        self.requests: set[str] = set()
        self.pending: list[Deliver] = []
        self.sending = False
        self.lost = False  # its stream failed: the replica is gone
        self.stream = handle.options(stream=True).listen.remote(channel, replica=pin)
        self.task = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        try:
            async for item in self.stream:
                self.on_emits(self, pickle.loads(item))
            raise RuntimeError(f"replica {self.pin} closed its stream")
        except asyncio.CancelledError:
            self.stream.cancel()
        except Exception as exc:  # noqa: BLE001 - the replica died: what it held fails
            self.lost = True
            self.on_lost(self, sorted(self.requests), exc)

    def deliver(self, msg: Deliver) -> None:
        self.pending.append(msg)
        if not self.sending:
            self.sending = True
            asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        try:
            while self.pending:
                batch, self.pending = self.pending, []
                unknown = await self.handle.deliver.remote(batch, replica=self.pin)
                if unknown:  # routed to another replica: this one is gone
                    self.on_lost(self, unknown, RuntimeError(f"replica {self.pin} is gone"))
        except Exception as exc:  # noqa: BLE001
            self.on_lost(self, sorted({m.request_id for m in batch}), exc)
        finally:
            self.sending = False

    def abort(self, rid: str) -> None:
        self.requests.discard(rid)
        asyncio.get_running_loop().create_task(self._abort(rid))

    async def _abort(self, rid: str) -> None:
        try:
            await self.handle.abort.remote(rid, replica=self.pin)
        except Exception:  # noqa: BLE001 - a replica that is gone holds nothing any more
            pass

    def close(self) -> None:
        self.stream.cancel()
        self.task.cancel()


class StageOpener:
    def __init__(self, handle: Any, channel: str):
        self.handle = handle
        self.channel = channel
        self.pending: list[tuple[str, list[Deliver], asyncio.Future[str]]] = []
        self._tasks: set[asyncio.Task] = set()

    def open(self, rid: str, delivers: list[Deliver]) -> asyncio.Future[str]:
        """The id of the replica that took the request, once its `open` call has returned."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((rid, delivers, future))
        task = loop.create_task(self._send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return future

    def withdraw(self, rid: str) -> bool:
        """Take back an open no call has taken yet (its future is cancelled): True when it was
        still waiting, so the replica never hears of the request."""
        for i, (pending_rid, _, future) in enumerate(self.pending):
            if pending_rid == rid:
                del self.pending[i]
                future.cancel()
                return True
        return False

    async def _send(self) -> None:
        # the first task to run takes what is pending (OPEN_BATCH at most), the next the rest;
        # the tasks of opens already taken find nothing and end
        batch, self.pending = self.pending[:OPEN_BATCH], self.pending[OPEN_BATCH:]
        if not batch:
            return
        try:
            pin = await self.handle.open.remote(self.channel, [(rid, delivers) for rid, delivers, _ in batch])
        except asyncio.CancelledError:  # the driver's loop is stopping
            for *_, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - each request of the call fails with it
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for *_, future in batch:
            if not future.done():
                future.set_result(pin)


class StageCall:
    def __init__(
        self,
        rid: str,
        replica: Replica,
        driver: Any,  # RayDriver: permits, opener_for, link_for, callbacks
    ):
        self.rid = rid
        self.replica = replica
        self.driver = driver
        self.pending: list[Deliver] = []
        self.link: ReplicaLink | None = None
        self.opening = False
        self.cancelled = False
        self.task = asyncio.get_running_loop().create_task(self._open())

    def deliver(self, msg: Deliver) -> None:
        if self.link is not None:
            self.link.deliver(msg)
        else:
            self.pending.append(msg)

    def cancel(self) -> None:
        self.cancelled = True
        if self.link is not None:
            self.link.abort(self.rid)
        elif not self.opening:
            self.task.cancel()  # still waiting for permits: nothing was opened
        else:  # an open still waiting is taken back; one in flight, _open aborts once it knows the replica
            self.driver.opener_for(self.replica.stage).withdraw(self.rid)

    async def _open(self) -> None:
        d, stage = self.driver, self.replica.stage
        try:
            edges = await d.permits.take(stage) if d.permits.free else ()
            if edges:
                d.on_permits(self.rid, self.replica, edges)
            self.opening = True
            batch, self.pending = self.pending, []
            pin = await d.opener_for(stage).open(self.rid, batch)
            link = d.link_for(stage, pin)
            link.requests.add(self.rid)
            self.link = link
            if self.cancelled:
                link.abort(self.rid)
                return
            for msg in self.pending:
                link.deliver(msg)
            self.pending = []
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - no replica took it: this request fails
            d.on_failure(self.rid, stage, exc)
