"""The hub's books: edge permits, shared-memory slots handed to stages, dead workers' segments.

Nothing here sends messages or touches requests' routing: each book records and answers,
and the orchestrator acts on the answers (under its lock, on the hub's behalf).

- EdgePermits: one multiprocessing semaphore per edge with `max_inflight`. A producer's worker
  takes a permit before adding a request and reports it at once (PermitsTaken); from then on
  the hub owns it and returns it when the consumer finishes the request or the request ends.
- SlotBook: which shared-memory reader slots were delivered to which stage for which request,
  kept until that stage finishes the request, so a reader that dies holding them can have
  them released for it (its tensors will never be freed).
- DeadSegments: a dead worker's own segment files, unlinked once every request that was in
  flight when it died has ended (a consumer may still have to open one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnistage.graph.spec import PipelineSpec
from omnistage.runtime.shm import SegmentPool, cleanup_prefix


class EdgePermits:
    def __init__(self, spec: PipelineSpec):
        self.spec = spec
        self.sems: dict[int, Any] = {}  # spec.edges index -> semaphore

    def open(self, ctx) -> None:
        for i, e in enumerate(self.spec.edges):
            if e.max_inflight and e.src.stage in self.spec.stages:
                self.sems[i] = ctx.Semaphore(int(e.max_inflight))

    def close(self) -> None:
        """Drop the semaphores once no worker uses them: multiprocessing unlinks each one's
        /dev/shm/sem.mp-* file when its last reference goes, not when the pipeline closes."""
        self.sems.clear()

    def of_producer(self, stage: str) -> dict[int, Any]:
        """The semaphores a stage's workers take from (its out-edges with max_inflight)."""
        return {i: self.sems[i] for i in self.spec.out_edge_ids(stage) if i in self.sems}

    def release(self, idx: int) -> str:
        """Return one permit of edge `idx`; gives the producer stage to tell."""
        self.sems[idx].release()
        return self.spec.edges[idx].src.stage

    def reconcile(self, stage: str, held: dict[int, int]) -> None:
        """A worker reports permits right after taking them, and the requests it held returned
        theirs when they failed; a kill between the take and the report would still leak one.
        Called when nobody but the hub touches the stage's semaphores (its only replica died),
        so each must be at max_inflight minus the permits the hub holds (`held`): top it up."""
        for idx, sem in self.of_producer(stage).items():
            try:
                missing = int(self.spec.edges[idx].max_inflight) - held.get(idx, 0) - sem.get_value()
            except NotImplementedError:  # no sem_getvalue (macOS)
                return
            for _ in range(max(0, missing)):
                sem.release()


@dataclass(frozen=True, slots=True)
class SentSlot:
    """A reader slot of one shared segment, delivered to a stage for a request."""

    producer: Any  # the producing Replica, None for the caller's inputs (the parent's pool)
    generation: int  # the producer's generation when it was sent
    segment: str
    use: int
    slot: int


class SlotBook:
    def __init__(self):
        self._sent: dict[str, dict[str, list[SentSlot]]] = {}  # request id -> stage -> slots

    def record(self, rid: str, stage: str, producer: Any, refs, slot: int) -> None:
        gen = producer.generation if producer is not None else 0
        entries = None
        for ref in refs:
            if entries is None:
                entries = self._sent.setdefault(rid, {}).setdefault(stage, [])
            entries.append(SentSlot(producer, gen, ref.segment, ref.use, slot))

    def stage_done(self, rid: str, stage: str) -> None:
        by_stage = self._sent.get(rid)
        if by_stage is not None:
            by_stage.pop(stage, None)

    def request_done(self, rid: str) -> None:
        self._sent.pop(rid, None)

    def release_for_dead_reader(self, stage: str, rids: list[str], parent_pool: SegmentPool) -> dict[Any, list]:
        """Forget the slots a dead replica of `stage` held for `rids`, releasing those of the
        parent's pool at once; returns, per live producer, the (segment, use, slot) triples it
        must release (a ReleaseSlots message). Releasing a slot the reader did free is harmless:
        the producer checks the segment is still in that use."""
        by_producer: dict[Any, list[tuple[str, int, int]]] = {}
        for rid in rids:
            for s in self._sent.get(rid, {}).pop(stage, ()):
                if s.producer is None:
                    parent_pool.force_release(s.segment, s.use, s.slot)
                elif s.producer.generation == s.generation and s.producer.conn is not None:
                    by_producer.setdefault(s.producer, []).append((s.segment, s.use, s.slot))
                # else: that producer died too; its segments are unlinked with it
        return by_producer


class DeadSegments:
    def __init__(self):
        self._waiting: list[tuple[str, set]] = []  # (dead worker's file prefix, requests it may feed)

    def add(self, files_prefix: str, live_requests) -> None:
        self._waiting.append((files_prefix, set(live_requests)))

    def reap(self, live_requests) -> list[str]:
        """Unlink the files of dead workers whose requests have all ended; returns their
        prefixes (readers drop their cached mappings of them)."""
        if not self._waiting:
            return []
        keep, reaped = [], []
        for prefix, rids in self._waiting:
            rids.intersection_update(live_requests)
            if rids:
                keep.append((prefix, rids))
                continue
            cleanup_prefix(prefix)
            reaped.append(prefix)
        self._waiting = keep
        return reaped
