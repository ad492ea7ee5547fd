"""The Pipeline API: the one way work is submitted to a stage graph (see docs/runtime.md).

p = Pipeline.from_yaml("configs/tiny-diamond.yaml")
out = p.run({"x": tensor}, params={"stage": {...}})
async for chunk in p.stream(inputs): ...
p.close()
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from typing import Any

from omnistage.errors import DeadlineExceededError, OmnistageError
from omnistage.graph.spec import PIPELINE_OUTPUTS, PipelineSpec
from omnistage.runtime.credit import CreditTally, data_nbytes, half_window
from omnistage.runtime.orchestrator import Orchestrator
from omnistage.runtime.routing import OutputChunk, RequestEnd
from omnistage.stages.contracts import combine_chunks

__all__ = ["Pipeline", "OutputChunk"]

_live: weakref.WeakSet[Pipeline] = weakref.WeakSet()


@atexit.register
def _close_leftovers() -> None:
    for p in list(_live):
        try:
            p.close(drain_timeout=0)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


class _LoopInbox:
    """Hands chunks from the hub thread to one event loop with one wake-up per burst: a decode
    step delivers a token chunk to every streaming request at once, and a wake-up per chunk
    (a self-pipe write each) costs the loop more than the chunks themselves."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Any]] = []

    def put(self, target: asyncio.Queue, item: Any) -> None:
        with self._lock:
            self._items.append((target, item))
            if len(self._items) > 1:
                return  # a drain is already scheduled and will take this item too
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for target, item in items:
            target.put_nowait(item)


class _CreditOutbox:
    """Returns the credit of the streamed output chunks a loop's readers took (runtime/credit.py):
    in half-window batches, and once per turn of the loop for all its streams (one hub call)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, orch: Orchestrator, half: dict[str, tuple[int, int]]):
        self._loop = loop
        self._orch = orch
        self._tally = CreditTally(half)
        self._scheduled = False

    def took(self, rid: str, port: str, nbytes: int) -> None:
        if self._tally.took(rid, port, nbytes) and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        due = self._tally.due()
        if due:
            self._orch.return_output_credit(due)

    def forget(self, rid: str) -> None:
        """The request ended: its producers keep no books for it any more."""
        self._tally.release(rid)


_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopInbox] = weakref.WeakKeyDictionary()


def _inbox(loop: asyncio.AbstractEventLoop) -> _LoopInbox:
    inbox = _inboxes.get(loop)
    if inbox is None:
        inbox = _inboxes[loop] = _LoopInbox(loop)  # only the loop's own thread gets here
    return inbox


class Pipeline:
    def __init__(self, spec: PipelineSpec, orchestrator: Orchestrator | None = None):
        """`orchestrator`: another implementation of its surface (ray_serve's RayDriver)."""
        self.spec = spec
        self.name = spec.name
        self._orch = Orchestrator(spec) if orchestrator is None else orchestrator
        self._outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _CreditOutbox] = (
            weakref.WeakKeyDictionary()
        )
        _live.add(self)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_yaml(
        cls,
        path_or_name: str,
        overrides: Iterable[str] = (),
        *,
        start: bool = True,
        wait_ready: bool = True,
        ready_timeout: float = 600,
    ) -> Pipeline:
        from omnistage.graph.loader import load_pipeline

        spec = load_pipeline(str(path_or_name), list(overrides))
        return cls.from_spec(spec, start=start, wait_ready=wait_ready, ready_timeout=ready_timeout)

    @classmethod
    def from_spec(
        cls, spec: PipelineSpec, *, start: bool = True, wait_ready: bool = True, ready_timeout: float = 600
    ) -> Pipeline:
        p = cls(spec)
        return p._start_and_wait(wait_ready, ready_timeout) if start else p

    def _start_and_wait(self, wait_ready: bool, ready_timeout: float) -> Pipeline:
        """Start; with `wait_ready`, block until every stage is ready (closed again if not)."""
        self.start()
        if wait_ready:
            try:
                self.wait_ready(ready_timeout)
            except BaseException:
                self.close(drain_timeout=0)
                raise
        return self

    def start(self) -> None:
        self._orch.start()

    def wait_ready(self, timeout: float | None = 600) -> None:
        self._orch.wait_ready(timeout)

    @property
    def ready(self) -> bool:
        return self._orch.ready

    def stage_ready(self) -> dict[str, bool]:
        """Stage name -> True when every replica of that stage has built its engine (local
        state: asks no worker, never blocks on a busy one)."""
        return self._orch.stage_ready()

    @property
    def closed(self) -> bool:
        return self._orch.closing or self._orch.closed

    @property
    def shm_prefix(self) -> str:
        return self._orch.shm_prefix

    def worker_pids(self) -> dict[str, list[int | None]]:
        return {
            s: [r.proc.pid if r.proc is not None else None for r in reps] for s, reps in self._orch.replicas.items()
        }

    # -- requests -------------------------------------------------------------------------------
    def run(
        self,
        inputs: dict[str, Any],
        params: dict[str, dict] | None = None,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        sink: queue.SimpleQueue = queue.SimpleQueue()
        deadline = time.time() + timeout if timeout is not None else None
        rid = self._orch.submit(inputs, params, sink.put, request_id, deadline)
        try:
            return self._collect(rid, sink, timeout)
        except BaseException as exc:
            # Ctrl+C (KeyboardInterrupt) or any other way out: the request stops in every stage
            # instead of running on (and holding close() for its drain timeout)
            if not isinstance(exc, OmnistageError):
                self.abort(rid)
            raise

    def _collect(self, rid: str, sink: queue.SimpleQueue, timeout: float | None) -> dict[str, Any]:
        chunks: dict[str, list[Any]] = {p: [] for p in self.spec.outputs}
        taken = CreditTally(self._output_half_windows if self._returns_credit else {})
        while True:
            if taken.has_due() and sink.empty():  # before waiting: a producer may be held back
                self._orch.return_output_credit(taken.due())
            try:
                # the hub enforces the deadline; the margin only guards against a stuck hub
                item = sink.get(timeout=None if timeout is None else timeout + 10.0)
            except queue.Empty:
                self.abort(rid)
                raise DeadlineExceededError(f"request {rid} exceeded its deadline") from None
            if isinstance(item, RequestEnd):
                if item.error is not None:
                    raise item.error
                return {p: combine_chunks(c) for p, c in chunks.items()}
            if item.port is not None and item.data is not None:
                chunks.setdefault(item.port, []).append(item.data)
                taken.took(rid, item.port, data_nbytes(item.data))

    @property
    def _returns_credit(self) -> bool:
        """The workers run with streaming credit and the orchestrator takes streamed outputs'
        credit back (ray_serve's driver does not)."""
        return getattr(self._orch, "stream_credit", False)

    def _credit_outbox(self, loop: asyncio.AbstractEventLoop) -> _CreditOutbox | None:
        if not self._returns_credit:
            return None
        outbox = self._outboxes.get(loop)
        if outbox is None:
            outbox = self._outboxes[loop] = _CreditOutbox(loop, self._orch, self._output_half_windows)
        return outbox

    @functools.cached_property
    def _output_half_windows(self) -> dict[str, tuple[int, int]]:
        """Each streamed output port's half credit window: what makes a return due."""
        return {
            e.dst.port: half_window(e.stream) for e in self.spec.edges if e.dst.stage == PIPELINE_OUTPUTS and e.stream
        }

    def _submit(self, inputs, params, request_id, deadline_s) -> tuple[str, asyncio.Queue, _CreditOutbox | None]:
        """Start a request whose chunks arrive in the returned queue (on this event loop)."""
        loop = asyncio.get_running_loop()
        inbox = _inbox(loop)
        items: asyncio.Queue = asyncio.Queue()

        def sink(item: Any) -> None:
            inbox.put(items, item)

        deadline = time.time() + deadline_s if deadline_s is not None else None
        rid = self._orch.submit(inputs, params, sink, request_id, deadline)
        return rid, items, self._credit_outbox(loop)

    def _ended(self, rid: str, outbox: _CreditOutbox | None, done: bool) -> None:
        if outbox is not None:
            outbox.forget(rid)
        if not done:
            self._orch.abort(rid)

    async def stream(
        self,
        inputs: dict[str, Any],
        params: dict[str, dict] | None = None,
        *,
        request_id: str | None = None,
        deadline_s: float | None = None,
    ) -> AsyncIterator[OutputChunk]:
        """The request's output chunks, in the order the stages emitted them."""
        rid, items, outbox = self._submit(inputs, params, request_id, deadline_s)
        done = False
        try:
            while True:
                item = await items.get()
                if isinstance(item, RequestEnd):
                    done = True
                    if item.error is not None:
                        raise item.error
                    return
                yield item
                if outbox is not None and item.port is not None and item.data is not None:
                    outbox.took(rid, item.port, data_nbytes(item.data))  # the reader is done with it
        finally:
            self._ended(rid, outbox, done)

    async def stream_batches(
        self,
        inputs: dict[str, Any],
        params: dict[str, dict] | None = None,
        *,
        request_id: str | None = None,
        deadline_s: float | None = None,
    ) -> AsyncIterator[list[OutputChunk]]:
        """The same chunks, as lists: each holds every chunk that had arrived when the reader
        came for more. A reader that writes each list out at once (an HTTP stream) wakes once
        per list, and one that fell behind catches up in one go."""
        rid, items, outbox = self._submit(inputs, params, request_id, deadline_s)
        done = False
        try:
            while True:
                batch = [await items.get()]
                while not items.empty() and not isinstance(batch[-1], RequestEnd):
                    batch.append(items.get_nowait())
                end = batch.pop() if isinstance(batch[-1], RequestEnd) else None
                if batch:
                    taken = [(c.port, data_nbytes(c.data)) for c in batch if c.port is not None and c.data is not None]
                    yield batch
                    batch = None  # the chunks (shared memory) are the reader's alone now
                    if outbox is not None:  # the reader is done with them
                        for port, nbytes in taken:
                            outbox.took(rid, port, nbytes)
                if end is not None:
                    done = True
                    if end.error is not None:
                        raise end.error
                    return
        finally:
            self._ended(rid, outbox, done)

    async def generate(
        self,
        inputs: dict[str, Any],
        params: dict[str, dict] | None = None,
        *,
        request_id: str | None = None,
        deadline_s: float | None = None,
    ) -> dict[str, Any]:
        """The whole outputs, as run() returns them (`deadline_s`: seconds from now, as run()'s
        `timeout`)."""
        chunks: dict[str, list[Any]] = {p: [] for p in self.spec.outputs}
        agen = self.stream(inputs, params, request_id=request_id, deadline_s=deadline_s)
        try:
            async for item in agen:
                if item.port is not None and item.data is not None:
                    chunks.setdefault(item.port, []).append(item.data)
        finally:
            await agen.aclose()
        return {p: combine_chunks(c) for p, c in chunks.items()}

    def abort(self, request_id: str) -> None:
        self._orch.abort(request_id)

    def num_requests(self) -> int:
        return self._orch.num_requests()

    # -- observability --------------------------------------------------------------------------
    def replica_stats(self, timeout: float = 2.0) -> dict[str, list[dict[str, Any]]]:
        """Fresh per-replica figures: queue_depth, inflight, batch/step histograms, outcomes, engine stats."""
        return self._orch.query_stats(timeout)

    def stage_stats(self, timeout: float = 2.0) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for stage, reps in self.replica_stats(timeout).items():
            agg: dict[str, Any] = {
                "replicas": len(reps),
                "ready_replicas": sum(1 for r in reps if r["ready"]),
                "restarts": sum(r["restarts"] for r in reps),
                "queue_depth": 0,
                "inflight": 0,
                "batch_size_last": 0,
                "step_ms_p50": 0.0,
            }
            p50s = []
            for r in reps:
                agg["queue_depth"] += r.get("queue_depth", 0)
                agg["inflight"] += r.get("inflight", 0)
                agg["batch_size_last"] = max(agg["batch_size_last"], r.get("batch_size_last", 0))
                if r.get("steps"):
                    p50s.append(r.get("step_ms_p50", 0.0))
                for k, v in (r.get("engine") or {}).items():
                    if isinstance(v, (int, float)):
                        agg[k] = agg.get(k, 0) + v
            agg["step_ms_p50"] = sorted(p50s)[len(p50s) // 2] if p50s else 0.0
            out[stage] = agg
        return out

    @property
    def request_counts(self) -> dict[str, int]:
        return dict(self._orch.counts)

    # -- shutdown -------------------------------------------------------------------------------
    def close(self, drain_timeout: float = 30.0) -> None:
        self._orch.close(drain_timeout)
        _live.discard(self)

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, stages={list(self.spec.stages)}, ready={self.ready})"
