"""Per-request flow control on streaming edges, like HTTP/2's stream windows.

Each streaming edge gives every request a window (`stream.credit` chunks and
`stream.credit_bytes` bytes of tensors). The producer's worker counts what it sent of a
request on the edge; once either bound is reached it pauses that request in its engine (the
others in the batch go on) until the consumer returns credit. A consumer stage's worker
returns credit for the chunks it handed to its engine once the engine stepped after taking
them (or at once when it has nothing to step), so a chunk counts until it was worked on; for
`outputs.*` edges the caller's reader returns it as it takes each chunk (runtime/pipeline.py).
The hub only forwards credit. A request that ends at a stage gives back the credit of the
chunks that stage took (its producer may still be writing) and drops its own producer books.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from omnistage.graph.spec import PipelineSpec
from omnistage.runtime.shm import CudaTensorRef, InlineTensor, ShmRef

Grant = tuple[str, int, int]  # (request id, edge index in spec.edges, chunks consumed)


def payload_nbytes(value: Any) -> int:
    """Bytes of the tensors in an encoded payload (token ids and text count as nothing)."""
    if isinstance(value, ShmRef):
        return value.nbytes
    if isinstance(value, InlineTensor):
        return len(value.data)
    if isinstance(value, CudaTensorRef):
        return len(value.blobs[0]) if value.blobs else 0
    if isinstance(value, dict):
        return sum(payload_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_nbytes(v) for v in value)
    return 0


class _Window:
    __slots__ = ("sizes", "nbytes")

    def __init__(self):
        self.sizes: deque[int] = deque()  # bytes of each chunk sent and not yet consumed
        self.nbytes = 0


class SendCredit:
    """The producer's side: what each request has outstanding on each streaming out-edge."""

    def __init__(self, spec: PipelineSpec, stage: str, enabled: bool = True):
        self.limits = {
            i: (max(1, e.stream.credit), max(1, e.stream.credit_bytes))
            for i, e in enumerate(spec.edges)
            if enabled and e.src.stage == stage and e.stream is not None
        }
        self._open: dict[str, dict[int, _Window]] = {}  # rid -> edge -> window
        self.blocked: set[str] = set()  # requests paused for want of credit

    def sent(self, rid: str, idx: int, nbytes: int) -> bool:
        """Count one chunk sent; True when the request has just run out of credit."""
        w = self._open.setdefault(rid, {}).setdefault(idx, _Window())
        w.sizes.append(nbytes)
        w.nbytes += nbytes
        if rid in self.blocked or not self._exhausted(idx, w):
            return False
        self.blocked.add(rid)
        return True

    def _exhausted(self, idx: int, w: _Window) -> bool:
        chunks, nbytes = self.limits[idx]
        return len(w.sizes) >= chunks or w.nbytes >= nbytes

    def granted(self, rid: str, idx: int, n: int) -> bool:
        """Credit for n consumed chunks came back; True when a blocked request may go on."""
        w = self._open.get(rid, {}).get(idx)
        if w is None:
            return False
        for _ in range(min(n, len(w.sizes))):
            w.nbytes -= w.sizes.popleft()
        if rid not in self.blocked or any(self._exhausted(i, x) for i, x in self._open[rid].items()):
            return False
        self.blocked.discard(rid)
        return True

    def on_emit(self, rid: str, outputs: dict[str, Any], finished: bool, port_edges: dict[str, list[int]]) -> bool:
        """Count an emission's chunks; True when the request has just run out of credit."""
        if finished:
            return False
        out = False
        for port, payload in outputs.items():
            for idx in port_edges.get(port, ()):
                if idx in self.limits:
                    out = self.sent(rid, idx, payload_nbytes(payload)) or out
        return out

    def drop(self, rid: str) -> bool:
        """The request ended here; True when it was paused."""
        self._open.pop(rid, None)
        if rid in self.blocked:
            self.blocked.discard(rid)
            return True
        return False

    def outstanding(self) -> int:
        """Chunks sent and not yet consumed, over all requests and edges (a gauge)."""
        return sum(len(w.sizes) for edges in self._open.values() for w in edges.values())


def data_nbytes(value: Any) -> int:
    """Bytes of the tensors / arrays in a decoded output chunk (as payload_nbytes counts them)."""
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return value.numel() * value.element_size()
    if hasattr(value, "nbytes") and hasattr(value, "dtype"):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(data_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], (int, float, str)):
        return sum(data_nbytes(v) for v in value)
    return 0


class CreditTally:
    """What a reader took and has not given back yet, per (request, edge or port). Credit goes
    back in batches, once half a window is due (like an HTTP/2 WINDOW_UPDATE): a producer
    that stops at a full window always has half of it with its reader, so it never waits on a
    return held back here, and a flow of one-token chunks costs one credit message per half
    window instead of one per chunk."""

    def __init__(self, half: dict[Any, tuple[int, int]]):
        self.half = half  # edge or port -> (chunks, bytes) that make a return due
        self._taken: dict[tuple[str, Any], list[int]] = {}
        self._due: set[tuple[str, Any]] = set()

    def took(self, rid: str, key: Any, nbytes: int) -> bool:
        """Count one chunk; True when its entry has just become due."""
        half = self.half.get(key)
        if half is None:
            return False
        entry = self._taken.setdefault((rid, key), [0, 0])
        entry[0] += 1
        entry[1] += nbytes
        if (entry[0] >= half[0] or entry[1] >= half[1]) and (rid, key) not in self._due:
            self._due.add((rid, key))
            return True
        return False

    def due(self, skip: set[str] | frozenset = frozenset()) -> list[Grant]:
        """(request id, key, chunks) of each entry with half a window taken, except skip's."""
        out = [(rid, key, self._taken.pop((rid, key))[0]) for rid, key in self._due if rid not in skip]
        self._due = {k for k in self._due if k[0] in skip} if skip else set()
        return out

    def release(self, rid: str) -> list[Grant]:
        """Everything `rid` took, due or not."""
        keys = [k for k in self._taken if k[0] == rid]
        self._due.difference_update(keys)
        return [(rid, key, self._taken.pop((rid, key))[0]) for _, key in keys]

    def has_due(self) -> bool:
        return bool(self._due)


def half_window(stream) -> tuple[int, int]:
    return max(1, stream.credit // 2), max(1, stream.credit_bytes // 2)


class ReturnCredit:
    """The consumer's side: chunks handed to the engine whose credit is still to be returned."""

    def __init__(self, spec: PipelineSpec, stage: str, enabled: bool = True):
        # streaming in-edges from another stage, by the consumer's port
        self.edge_of_port = {
            e.dst.port: i
            for i, e in enumerate(spec.edges)
            if enabled and e.dst.stage == stage and e.stream is not None and e.src.stage in spec.stages
        }
        self._tally = CreditTally({i: half_window(spec.edges[i].stream) for i in self.edge_of_port.values()})

    def took(self, rid: str, port: str | None, payload: Any = None) -> None:
        """One chunk (its encoded payload) of a request came in on `port`."""
        idx = self.edge_of_port.get(port)
        if idx is not None:
            self._tally.took(rid, idx, payload_nbytes(payload))

    def take_grants(self, paused: set[str]) -> list[Grant]:
        """Called once the engine stepped after taking the chunks, or found nothing to step
        (an engine that keeps chunks until the port closes must still get the rest). A request
        paused here keeps its credit until it goes on, so a slow reader holds back the whole
        chain of stages behind it, not only the last one."""
        return self._tally.due(paused) if self._tally.has_due() else []

    def release(self, rid: str) -> list[Grant]:
        """The request ended here: the credit of every chunk it took goes back at once, paused
        or not. Its producer may still be writing (a talker that ends before its thinker), and
        credit kept here would hold that producer back for good."""
        return self._tally.release(rid)
