"""One request at one stage deployment: a StageCall, and the edge permits the driver holds.

A StageCall opens the replica's `open` stream (after taking the stage's edge permits, as the
embedded worker does before adding a request), learns the replica's id from its first item,
then relays the request's deliveries to that replica in batches (one call in flight; what
arrives meanwhile leaves together in the next) and hands each batch of emits it streams back
to the driver. Cancelling it cancels the stream, which aborts the request in that engine.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from omnistage.graph.spec import PipelineSpec
from omnistage.runtime.messages import Deliver, Emit
from omnistage.runtime.replicas import Replica


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


class StageCall:
    def __init__(
        self,
        rid: str,
        replica: Replica,
        handle: Any,
        permits: DriverPermits,
        on_permits: Callable[[str, Replica, tuple[int, ...]], None],
        on_emits: Callable[[Replica, list[Emit]], None],
        on_failure: Callable[[str, Replica, BaseException], None],
    ):
        self.rid = rid
        self.replica = replica
        self.handle = handle
        self.permits = permits
        self.on_permits = on_permits
        self.on_emits = on_emits
        self.on_failure = on_failure
        self.pending: list[Deliver] = []
        self.pin: str | None = None
        self.sending = False
        self.stream: Any = None
        self.task = asyncio.get_running_loop().create_task(self._run())

    def deliver(self, msg: Deliver) -> None:
        self.pending.append(msg)
        if self.pin is not None and not self.sending:
            self.sending = True
            asyncio.get_running_loop().create_task(self._send())

    def cancel(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
        self.task.cancel()

    async def _run(self) -> None:
        try:
            edges = await self.permits.take(self.replica.stage) if self.permits.free else ()
            if edges:
                self.on_permits(self.rid, self.replica, edges)
            self.stream = self.handle.options(stream=True).open.remote(self.rid)
            self.pin = await self.stream.__anext__()
            if self.pending and not self.sending:
                self.sending = True
                asyncio.get_running_loop().create_task(self._send())
            async for emits in self.stream:
                self.on_emits(self.replica, emits)
        except asyncio.CancelledError:
            if self.stream is not None:
                self.stream.cancel()
        except Exception as exc:  # noqa: BLE001 - the replica died or refused: this request fails
            self.on_failure(self.rid, self.replica, exc)

    async def _send(self) -> None:
        try:
            while self.pending:
                batch, self.pending = self.pending, []
                await self.handle.deliver.remote(self.rid, batch, replica=self.pin)
        except Exception as exc:  # noqa: BLE001
            self.on_failure(self.rid, self.replica, exc)
        finally:
            self.sending = False
