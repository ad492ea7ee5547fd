"""Routing: moves each request's data along the pipeline's edges, from its inputs to the caller.

The Router holds the requests in flight and, for each, the replica chosen per stage (the least
loaded ready one on first delivery, then sticky). A producer's emission goes along its port's
out-edges: to the consumer's replica as a Deliver message (payload refs untouched, never
decoded) or, for `outputs.*` edges, to the caller's sink. When every stage has finished a
request, or it fails anywhere, `finish` ends it everywhere: aborts, returned permits, the
caller's RequestEnd. Every method runs under the orchestrator's lock, on its hub's behalf.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omnistage.errors import InvalidRequestError, StageError, WorkerDiedError, invalid_request
from omnistage.graph.spec import PIPELINE_INPUTS, PIPELINE_OUTPUTS, PipelineSpec
from omnistage.runtime.ledger import EdgePermits, SlotBook
from omnistage.runtime.messages import Abort, Credit, Deliver, Emit, PermitFreed, PermitsTaken, RequestMeta, send_msg
from omnistage.runtime.replicas import Replica, ReplicaState
from omnistage.runtime.shm import SegmentReader, decode, iter_refs, release_all
from omnistage.runtime.watchdog import holds_back
from omnistage.stages.contracts import combine_chunks

log = logging.getLogger("omnistage.runtime")

OUTCOMES = ("ok", "error", "invalid", "cancelled", "deadline", "rejected", "worker_died", "closed")


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


def safe_sink(sink: Sink) -> Sink:
    def put(item: Any) -> None:
        try:
            sink(item)
        except Exception:  # noqa: BLE001 - a caller gone (closed event loop) must not stop the hub
            log.debug("dropping an item for a caller that went away", exc_info=True)

    return put


@dataclass(eq=False)
class RequestRecord:
    rid: str
    sink: Sink
    params: dict[str, dict]
    deadline: float | None
    replicas: dict[str, Replica] = field(default_factory=dict)
    open_stages: set = field(default_factory=set)
    hub_permits: set = field(default_factory=set)  # edge indices whose permit the hub must return
    out_buffers: dict = field(default_factory=dict)  # non-streaming output edge -> chunks so far
    # edges from a port declared absent whose consumer has not seen the request: idx -> (src, slot)
    absent_edges: dict = field(default_factory=dict)


class Router:
    def __init__(
        self,
        spec: PipelineSpec,
        replicas: dict[str, list[Replica]],
        permits: EdgePermits,
        slots: SlotBook,
        reader: SegmentReader,
        cond: threading.Condition,
    ):
        self.spec = spec
        self.replicas = replicas
        self.permits = permits
        self.slots = slots
        self.reader = reader
        self.cond = cond  # notified whenever a request ends
        self.requests: dict[str, RequestRecord] = {}
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.skipped_stages = 0  # (request, stage) pairs never admitted: every input was absent
        self.port_edges = {name: spec.out_edge_ids_by_port(name) for name in [*spec.stages, PIPELINE_INPUTS]}
        self.in_edge_idx = {name: spec.in_edge_ids(name) for name in spec.stages}
        self.sources = [n for n in spec.stages if not self.in_edge_idx[n]]
        self.output_streams: dict[str, list[int]] = {}  # outputs port -> its streaming edges from stages
        for i, e in enumerate(spec.edges):
            if e.dst.stage == PIPELINE_OUTPUTS and e.stream is not None and e.src.stage in spec.stages:
                self.output_streams.setdefault(e.dst.port, []).append(i)

    def start(self, req: RequestRecord, encoded: dict[str, Any]) -> None:
        """Route a newly admitted request's inputs (encoded per given port) and start the
        stages that have no input edge."""
        self.requests[req.rid] = req
        for port in self.spec.inputs:
            # an input left out closes its consumers' ports without data (optional ports)
            given = port in encoded
            payload = encoded.get(port)
            for slot, idx in enumerate(self.port_edges[PIPELINE_INPUTS].get(port, [])):
                self.deliver(req, PIPELINE_INPUTS, idx, slot, payload, given, True)
        for stage in self.sources:
            self.send(self.replica_for(req, stage), Deliver(req.rid, None, None, 0, True, False, self.meta(req, stage)))

    def on_permits_taken(self, r: Replica, msg: PermitsTaken) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.replicas.get(r.stage) is not r or r.stage not in req.open_stages:
            for idx in msg.edges:  # the request ended meanwhile
                self.release_permit(idx)
        else:
            req.hub_permits.update(msg.edges)

    def meta(self, req: RequestRecord, stage: str) -> RequestMeta:
        return RequestMeta(dict(req.params.get(stage) or {}), req.deadline)

    def replica_for(self, req: RequestRecord, stage: str) -> Replica:
        r = req.replicas.get(stage)
        if r is None:
            reps = [x for x in self.replicas[stage] if x.state is not ReplicaState.DEAD]
            fresh = [x for x in reps if x.ready and not x.health.draining]  # a draining one takes nothing new
            ready = fresh or [x for x in reps if x.ready] or reps or self.replicas[stage]
            # fewest in flight; among those, the one given fewest so far, or short requests
            # arriving one at a time would all land on the first replica
            r = min(ready, key=lambda x: (len(x.requests), x.routed))
            req.replicas[stage] = r
            r.requests.add(req.rid)
            r.routed += 1
        return r

    def send(self, r: Replica, msg) -> None:
        if not r.ready or holds_back(r, msg):
            r.pending.append(msg)
            return
        try:
            send_msg(r.conn, msg)
        except OSError:
            pass  # the worker died; its sentinel fires and the hub fails its requests

    def deliver(
        self, req: RequestRecord, src_stage: str, idx: int, slot: int, payload: Any, has_data: bool, last: bool
    ) -> None:
        e = self.spec.edges[idx]
        if e.dst.stage == PIPELINE_OUTPUTS:
            self._deliver_output(req, src_stage, idx, slot, payload, has_data, last)
            return
        if req.rid not in self.requests:
            return  # failed while this emission was being routed
        dst = e.dst.stage
        first = dst not in req.replicas
        r = self.replica_for(req, dst)
        if r.state is ReplicaState.DEAD:
            self.finish(
                req,
                WorkerDiedError.replica_gone(dst, r.index, r.error),
                "worker_died",
            )
            return
        if has_data:
            self.slots.record(req.rid, dst, req.replicas.get(src_stage), iter_refs(payload), slot)
        self.send(
            r, Deliver(req.rid, e.dst.port, payload, slot, last, has_data, self.meta(req, dst) if first else None)
        )
        if first:  # the consumer runs after all: its absent inputs close as ordinary empty ports
            for held in [i for i in self.in_edge_idx[dst] if i in req.absent_edges]:
                src, held_slot = req.absent_edges.pop(held)
                self.deliver(req, src, held, held_slot, None, False, True)

    def _deliver_output(
        self, req: RequestRecord, src_stage: str, idx: int, slot: int, payload: Any, has_data: bool, last: bool
    ) -> None:
        e = self.spec.edges[idx]
        data = decode(payload, self.reader, slot) if has_data else None
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

    def finish(self, req: RequestRecord, error: BaseException | None, outcome: str) -> None:
        """End a request: abort it where it still runs, return permits, tell the caller."""
        self.requests.pop(req.rid, None)
        self.slots.request_done(req.rid)
        for stage, r in req.replicas.items():
            if req.rid in r.requests:
                r.requests.discard(req.rid)
                if stage in req.open_stages and error is not None:
                    self.send(r, Abort(req.rid))
        req.open_stages.clear()
        for idx in req.hub_permits:
            self.release_permit(idx)
        req.hub_permits.clear()
        self.counts[outcome] += 1
        req.sink(RequestEnd(req.rid, error))
        self.cond.notify_all()

    def _absent_edge(self, req: RequestRecord, src: str, idx: int, slot: int) -> None:
        """Edge idx will carry nothing for this request. A consumer that already has the request
        (or the caller) gets an ordinary empty close; one that has not is held back, and skipped
        once every one of its input edges is absent."""
        dst = self.spec.edges[idx].dst.stage
        if dst == PIPELINE_OUTPUTS or dst in req.replicas or req.rid not in self.requests:
            self.deliver(req, src, idx, slot, None, False, True)
            return
        req.absent_edges[idx] = (src, slot)
        if all(i in req.absent_edges for i in self.in_edge_idx[dst]):
            self._skip_stage(req, dst)

    def _skip_stage(self, req: RequestRecord, stage: str) -> None:
        """The request never reaches `stage`: it is done there and all its outputs are absent."""
        for i in self.in_edge_idx[stage]:
            req.absent_edges.pop(i, None)
        req.open_stages.discard(stage)
        self.slots.stage_done(req.rid, stage)
        self.skipped_stages += 1
        for edges in self.port_edges[stage].values():
            for slot, idx in enumerate(edges):
                self._absent_edge(req, stage, idx, slot)

    def return_credit(self, grants) -> None:
        """Forward consumed chunks' credit (request id, edge, chunks) to each edge's producer
        replica (runtime/credit.py); requests that ended meanwhile are skipped."""
        by_replica: dict[Replica, list] = {}
        for rid, idx, n in grants:
            req = self.requests.get(rid)
            src = self.spec.edges[idx].src.stage
            producer = req.replicas.get(src) if req is not None else None
            if producer is not None and src in req.open_stages:
                by_replica.setdefault(producer, []).append((rid, idx, n))
        for r, mine in by_replica.items():
            self.send(r, Credit(mine))

    def return_output_credit(self, acks) -> None:
        """The caller took chunks of streaming outputs: (request id, outputs port, chunks) each."""
        self.return_credit([(rid, idx, n) for rid, port, n in acks for idx in self.output_streams.get(port, ())])

    def release_permit(self, idx: int) -> None:
        producer = self.permits.release(idx)
        for r in self.replicas[producer]:
            if r.ready:
                self.send(r, PermitFreed(idx))

    def release_unrouted(self, stage: str, outputs: dict[str, Any]) -> None:
        """Free the reader slots of an emission nobody will read."""
        port_edges = self.port_edges[stage]
        for port, payload in outputs.items():
            for slot in range(len(port_edges.get(port, ()))):
                release_all(payload, self.reader, slot)

    def on_emit(self, r: Replica, msg: Emit) -> None:
        stage = r.stage
        req = self.requests.get(msg.request_id)
        if req is None or req.replicas.get(stage) is not r or stage not in req.open_stages:
            self.release_unrouted(stage, msg.outputs)
            return
        if msg.error is not None:
            self.release_unrouted(stage, msg.outputs)
            if msg.error_kind.partition(":")[0] == "invalid_request":
                self.finish(req, _invalid(stage, msg), "invalid")
            else:
                self.finish(req, StageError(stage, msg.error), "error")
            return
        port_edges = self.port_edges[stage]
        for port, payload in msg.outputs.items():
            for slot, idx in enumerate(port_edges.get(port, ())):
                self.deliver(req, stage, idx, slot, payload, True, msg.finished)
        if msg.progress is not None:
            req.sink(OutputChunk(req.rid, None, None, False, tuple(msg.progress), stage))
        if msg.finished:
            self._stage_finished(req, r, port_edges, msg.outputs, msg.absent_ports)

    def _stage_finished(
        self, req: RequestRecord, r: Replica, port_edges: dict, outputs: dict, absent: tuple[str, ...] = ()
    ) -> None:
        stage = r.stage
        for port, edges in port_edges.items():
            if port not in outputs:
                for slot, idx in enumerate(edges):
                    if port in absent:
                        self._absent_edge(req, stage, idx, slot)
                    else:
                        self.deliver(req, stage, idx, slot, None, False, True)
        req.open_stages.discard(stage)
        self.slots.stage_done(req.rid, stage)
        r.requests.discard(req.rid)
        for idx in self.in_edge_idx[stage]:
            if idx in req.hub_permits:
                req.hub_permits.discard(idx)
                self.release_permit(idx)
        if not req.open_stages:
            self.finish(req, None, "ok")


def _invalid(stage: str, msg: Emit) -> InvalidRequestError:
    """The request's own fault reported by a stage, with the stage's error code when it sent one."""
    return invalid_request(f"stage {stage!r}: {msg.error}", msg.param, msg.error_kind.partition(":")[2] or None)
