"""Messages between the orchestrator (parent) and stage workers. Plain picklable dataclasses;
payloads are encoded with runtime.shm (large CPU tensors travel as ShmRefs)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

NOTHING = None  # payload of a "port closed, no more data" delivery


@dataclass(slots=True)
class RequestMeta:
    params: dict[str, Any] = field(default_factory=dict)  # this stage's per-request params
    deadline: float | None = None  # time.time() seconds


# -- parent -> worker -----------------------------------------------------------------------
@dataclass(slots=True)
class Deliver:
    """Data for one input port of a request (or a start signal when port is None).
    `slot` is the reader slot of the edge it came over; `last` closes the port."""

    request_id: str
    port: str | None
    payload: Any
    slot: int
    last: bool
    has_data: bool
    meta: RequestMeta | None = None  # sent with the first delivery of a request to a stage


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class StatsQuery:
    seq: int


@dataclass(slots=True)
class Shutdown:
    pass


@dataclass(slots=True)
class OverMemory:
    """Worker -> hub: its resident set passed pool.max_rss (runtime/watchdog.py)."""

    rss: int


@dataclass(slots=True)
class PermitFreed:
    """An in-flight permit of one of the worker's out-edges was returned: retry admission."""

    edge: int


@dataclass(slots=True)
class Credit:
    """Chunks the consumers of the worker's streaming out-edges consumed (runtime/credit.py):
    (request id, edge index, chunks) each."""

    grants: list[tuple[str, int, int]]


@dataclass(slots=True)
class ReleaseSlots:
    """Reader slots of this worker's segments that a dead reader never released:
    (segment name, segment use, slot) each; applied only while the segment is still in that use."""

    slots: list[tuple[str, int, int]]


@dataclass(slots=True)
class ForgetSegments:
    """A dead producer's segments (file names starting with `prefix`) were unlinked: drop
    their cached mappings."""

    prefix: str


# -- worker -> parent -----------------------------------------------------------------------
@dataclass(slots=True)
class PermitsTaken:
    """The worker took in-flight permits of these out-edges (indices in spec.edges) for a
    request; the orchestrator returns them."""

    request_id: str
    edges: tuple[int, ...]


@dataclass(slots=True)
class Consumed:
    """Worker -> hub: chunks of streaming in-edges its engine worked on, whose credit goes back
    to their producers: (request id, edge index, chunks) each."""

    grants: list[tuple[str, int, int]]


@dataclass(slots=True)
class Ready:
    pid: int


@dataclass(slots=True)
class StartFailed:
    error: str  # one line, "TypeError: message": it may reach clients
    traceback: str = ""  # for the server log only


@dataclass(slots=True)
class Emit:
    request_id: str
    outputs: dict[str, Any]  # port -> encoded payload
    finished: bool
    error: str | None = None
    error_kind: str = "internal"
    progress: tuple[int, int] | None = None
    param: str | None = None  # the request parameter an invalid_request error names
    absent_ports: tuple[str, ...] = ()  # with finished: ports this request never produced


@dataclass(slots=True)
class EmitBatch:
    """The emissions of one engine step, in order: one message (one pickle, one wake-up of
    the hub) instead of one per request — an LLM decode step emits for every sequence."""

    emits: list[Emit]


@dataclass(slots=True)
class StatsReply:
    seq: int
    stats: dict[str, Any]


def send_msg(conn, msg) -> None:
    """Standard pickle, not multiprocessing's ForkingPickler: payload tensors are already
    encoded (runtime.shm), and torch's reductions would move stray CPU tensors into
    fd-passing shared memory."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv_msg(conn):
    return pickle.loads(conn.recv_bytes())
