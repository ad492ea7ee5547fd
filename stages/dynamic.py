"""Dynamic batching: a reusable engine base for stages that finish a request in one batched call.

Subclasses implement `forward_batch(requests) -> list[result]`, one result per request, each
    - a dict {output port: value}: the request's whole output (one final emission), or
    - an Exception: that request failed (InvalidRequestError => error_kind "invalid_request"), or
    - an iterator of dicts: the output in chunks, one chunk per engine step (the request stays
      in the engine until the iterator is exhausted; other requests keep batching meanwhile).
When `forward_batch` raises for a batch of several requests, each member is retried alone,
so one poisoned request fails by itself while its batch mates complete.

Knobs (BatchingSpec): policy "dynamic" batches up to `max_batch_size` requests and waits at
most `max_wait_ms` after the oldest ready request for the batch to fill; policy "none" runs
each request alone at once. `batch_key(request)` keeps incompatible requests (e.g. different
shapes) out of one batch; the oldest request's key is served first.

Streaming input ports (Port.streaming) are accumulated by `feed()` and concatenated; the
request becomes ready once every required streaming port has received its last chunk.
Subclasses wanting per-chunk work override `feed()`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from omnistage.stages.base import Emission, StageContext, StageEngine, StageRequest, StepRecord
from omnistage.stages.contracts import combine_chunks, error_emission


@dataclass
class _Pending:
    request: StageRequest
    streamed: dict[str, list[Any]] = field(default_factory=dict)  # port -> chunks so far
    closed: set[str] = field(default_factory=set)  # streaming ports whose last chunk came
    ready_at: float | None = None  # monotonic time it became ready


class DynamicBatchEngine(StageEngine):
    batching_policies = ("dynamic", "none")

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        b = ctx.batching
        dynamic = b.policy == "dynamic"
        self.max_batch_size = max(1, b.max_batch_size) if dynamic else 1
        self.max_wait_s = max(0.0, b.max_wait_ms / 1000.0) if dynamic else 0.0
        in_ports, _ = self.ports(ctx.params)
        self._required_streams = {n for n, p in in_ports.items() if p.streaming and not p.optional}
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._ready: OrderedDict[str, _Pending] = OrderedDict()  # insertion = readiness order
        self._iterators: OrderedDict[str, Iterator[dict[str, Any]]] = OrderedDict()
        self.batches_total = 0
        self.requests_total = 0
        self.errors_total = 0
        self.batch_size_max = 0

    # -- what subclasses implement ---------------------------------------------------------
    def forward_batch(self, requests: list[StageRequest]) -> list[Any]:
        raise NotImplementedError

    def batch_key(self, request: StageRequest) -> Hashable:
        return None

    # -- protocol ---------------------------------------------------------------------------
    def add(self, request: StageRequest) -> None:
        entry = _Pending(request)
        self._pending[request.request_id] = entry
        self._maybe_ready(entry)

    def feed(self, request_id: str, port: str, chunk: Any, last: bool) -> None:
        entry = self._pending.get(request_id)
        if entry is None:
            return  # aborted or unknown: drop
        entry.streamed.setdefault(port, []).append(chunk)
        if last:
            entry.closed.add(port)
        self._maybe_ready(entry)

    def _maybe_ready(self, entry: _Pending) -> None:
        waiting = (self._required_streams | set(entry.streamed)) - entry.closed
        if waiting:
            return
        for port, chunks in entry.streamed.items():
            entry.request.inputs[port] = combine_chunks(chunks)
        entry.streamed.clear()
        entry.ready_at = time.monotonic()
        rid = entry.request.request_id
        del self._pending[rid]
        self._ready[rid] = entry

    def abort(self, request_id: str) -> None:
        self.paused.discard(request_id)
        self._pending.pop(request_id, None)
        self._ready.pop(request_id, None)
        it = self._iterators.pop(request_id, None)
        if it is not None and hasattr(it, "close"):
            try:
                it.close()
            except Exception:  # noqa: BLE001 - a generator failing to close must not kill the loop
                pass

    def num_requests(self) -> int:
        return len(self._pending) + len(self._ready) + len(self._iterators)

    def _runnable_iterators(self) -> bool:
        return any(rid not in self.paused for rid in self._iterators) if self.paused else bool(self._iterators)

    def has_work(self) -> bool:
        if self._runnable_iterators():
            return True
        if not self._ready:
            return False
        if self.max_wait_s <= 0:
            return True
        oldest = next(iter(self._ready.values()))
        if time.monotonic() - oldest.ready_at >= self.max_wait_s:
            return True
        return self._oldest_batch_full()

    def _oldest_batch_full(self) -> bool:
        """The oldest request's batch (requests with its batch_key) already has max_batch_size."""
        if len(self._ready) < self.max_batch_size:
            return False
        entries = iter(self._ready.values())
        key = self.batch_key(next(entries).request)
        n = 1
        for entry in entries:
            if self.batch_key(entry.request) == key:
                n += 1
                if n >= self.max_batch_size:
                    return True
        return n >= self.max_batch_size

    def next_wakeup(self) -> float | None:
        if self._runnable_iterators():
            return 0.0
        if not self._ready:
            return None
        if self._oldest_batch_full():
            return 0.0
        oldest = next(iter(self._ready.values()))
        return max(0.0, oldest.ready_at + self.max_wait_s - time.monotonic())

    def step(self) -> list[Emission]:
        emissions: list[Emission] = []
        for rid in list(self._iterators):
            if rid not in self.paused:  # a paused request keeps its place; the others go on
                emissions.append(self._advance(rid))
        if self.has_work() and self._ready:
            emissions.extend(self._run_batch(self._take_batch()))
        return emissions

    def stats(self) -> dict[str, float]:
        return {
            "pending": float(len(self._pending) + len(self._ready)),
            "streaming_outputs": float(len(self._iterators)),
            "batches_total": float(self.batches_total),
            "requests_total": float(self.requests_total),
            "errors_total": float(self.errors_total),
            "batch_size_max": float(self.batch_size_max),
        }

    # -- internals --------------------------------------------------------------------------
    def _take_batch(self) -> list[StageRequest]:
        entries = iter(self._ready.values())
        first = next(entries)
        key = self.batch_key(first.request)
        batch = [first.request]
        for entry in entries:
            if len(batch) >= self.max_batch_size:
                break
            if self.batch_key(entry.request) == key:
                batch.append(entry.request)
        for r in batch:
            del self._ready[r.request_id]
        return batch

    def _run_batch(self, batch: list[StageRequest]) -> list[Emission]:
        t0 = time.perf_counter()
        try:
            results = list(self.forward_batch(batch))
            if len(results) != len(batch):
                raise RuntimeError(f"forward_batch returned {len(results)} results for {len(batch)} requests")
        except Exception as exc:  # noqa: BLE001 - isolate the failing member(s)
            if len(batch) == 1:
                results = [exc]
            else:
                results = []
                for r in batch:
                    try:
                        results.extend(self.forward_batch([r])[:1])
                    except Exception as single_exc:  # noqa: BLE001
                        results.append(single_exc)
        self.batches_total += 1
        self.requests_total += len(batch)
        self.batch_size_max = max(self.batch_size_max, len(batch))
        self.step_log.append(StepRecord(tuple(r.request_id for r in batch), len(batch), time.perf_counter() - t0))
        emissions = []
        for request, result in zip(batch, results):
            rid = request.request_id
            if isinstance(result, BaseException):
                self.errors_total += 1
                emissions.append(error_emission(rid, result))
            elif isinstance(result, dict):
                emissions.append(Emission(rid, outputs=result, finished=True))
            else:
                self._iterators[rid] = iter(result)
                emissions.append(self._advance(rid))
        return emissions

    def _advance(self, rid: str) -> Emission:
        it = self._iterators[rid]
        try:
            chunk = next(it)
        except StopIteration:
            del self._iterators[rid]
            return Emission(rid, finished=True)
        except Exception as exc:  # noqa: BLE001
            del self._iterators[rid]
            self.errors_total += 1
            return error_emission(rid, exc)
        return Emission(rid, outputs=dict(chunk or {}))


class PreparedBatchEngine(DynamicBatchEngine):
    """Dynamic batching for stages that parse each request once, when it is added.

    `prepare(request)` returns a tuple whose element 1 is the request's batch key; a raised
    `prepare_errors` exception is kept instead and handed back by `forward_batch` as that
    request's own failure. Subclasses pop their entries from `self._parsed` in forward_batch
    (`forward_items` does, for kinds that encode a list of items per request).
    """

    prepare_errors: tuple[type[BaseException], ...] = (Exception,)

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        self._parsed: dict[str, Any] = {}  # request id -> prepare()'s tuple or its error

    def prepare(self, request: StageRequest) -> tuple:
        raise NotImplementedError

    def add(self, request: StageRequest) -> None:
        try:
            self._parsed[request.request_id] = self.prepare(request)
        except self.prepare_errors as exc:
            self._parsed[request.request_id] = exc
        super().add(request)

    def abort(self, request_id: str) -> None:
        self._parsed.pop(request_id, None)
        super().abort(request_id)

    def batch_key(self, request: StageRequest) -> Hashable:
        parsed = self._parsed.get(request.request_id)
        return parsed[1] if isinstance(parsed, tuple) else ("error", request.request_id)

    def forward_items(
        self,
        requests: list[StageRequest],
        encode: Callable[[list[Any]], Sequence[Any]],
        output: Callable[[list[Any], list[Any]], dict[str, Any]],
    ) -> list[Any]:
        """forward_batch for kinds whose `prepare` returns (items, key): the items of every
        request in the batch go through one `encode` call (one result per item, in order),
        and each request gets `output(its items, their results)`; a request whose prepare
        failed gets its error. Entries stay until the forward succeeds, because a failed
        batch is retried request by request."""
        parsed = [self._parsed[r.request_id] for r in requests]
        try:
            items = [item for p in parsed if not isinstance(p, BaseException) for item in p[0]]
            encoded = iter(encode(items) if items else [])
            results = [
                p if isinstance(p, BaseException) else output(p[0], [next(encoded) for _ in p[0]]) for p in parsed
            ]
        finally:
            if len(requests) == 1:
                self._parsed.pop(requests[0].request_id, None)
        for r in requests:
            self._parsed.pop(r.request_id, None)
        return results
