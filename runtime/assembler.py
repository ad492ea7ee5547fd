"""Turns the deliveries arriving at a stage into engine calls; no transport knowledge.

- fan-in join: a request is `add`ed once every connected non-streaming input port is complete
  (chunks of a multi-chunk producer are concatenated: tensors along dim 0, str joined, lists
  extended);
- streaming ports are re-chunked to `stream.chunk` items along dim 0 with `left_context` items
  of overlap and `feed`-ed (tensors and lists; text, bytes and dicts pass through chunk by
  chunk as produced); chunks arriving before the request can be added are buffered and
  fed right after the add. When a streaming port closes with no remainder, an empty chunk
  (`data[:0]`) is fed with last=True.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.graph.spec import StreamSpec
from omnistage.runtime.messages import RequestMeta
from omnistage.stages.base import StageRequest
from omnistage.stages.contracts import combine_chunks


def _seq_len(x: Any) -> int | None:
    """Items along dim 0 of a re-chunkable value (tensors with a dim, lists, tuples); None for
    values passed through as they come (text deltas, bytes, dicts, scalars)."""
    if isinstance(x, torch.Tensor):
        return x.shape[0] if x.dim() > 0 else None
    if isinstance(x, (list, tuple)):
        return len(x)
    return None


class Rechunker:
    """Re-chunks one streaming port of one request."""

    def __init__(self, stream: StreamSpec):
        self.chunk = max(1, int(stream.chunk))
        self.left_context = max(0, int(stream.left_context))
        self.buf: Any = None
        self.context: Any = None  # last left_context items already fed
        self.sample: Any = None  # something to take an empty slice of

    def push(self, data: Any, has_data: bool, last: bool) -> list[tuple[Any, bool]]:
        out: list[tuple[Any, bool]] = []
        if has_data and _seq_len(data) is None:
            # not sliceable along dim 0 (dict, scalar...): pass through as is
            return [(data, last)]
        if has_data:
            self.sample = data
            self.buf = data if self.buf is None else combine_chunks([self.buf, data])
        while self.buf is not None and _seq_len(self.buf) >= self.chunk:
            piece, self.buf = self.buf[: self.chunk], self.buf[self.chunk :]
            if _seq_len(self.buf) == 0:
                self.buf = None
            is_last = last and self.buf is None
            out.append((self._with_context(piece), is_last))
        if last and self.buf is not None:
            out.append((self._with_context(self.buf), True))
            self.buf = None
        elif last and not (out and out[-1][1]):
            out.append((self.sample[:0] if self.sample is not None else None, True))
        return out

    def _with_context(self, piece: Any) -> Any:
        full = piece if self.context is None else combine_chunks([self.context, piece])
        if self.left_context:
            n = _seq_len(full)
            self.context = full[max(0, n - self.left_context) :]
        return full


@dataclass
class _Assembly:
    meta: RequestMeta | None = None
    chunks: dict[str, list[Any]] = field(default_factory=dict)  # non-streaming port -> chunks
    closed: set[str] = field(default_factory=set)
    streams: dict[str, Rechunker] = field(default_factory=dict)
    early_feeds: list[tuple[str, Any, bool]] = field(default_factory=list)
    added: bool = False
    started: bool = False


class InputAssembler:
    """in_ports: every connected input port of the stage -> its edge's StreamSpec (None for a
    non-streaming edge). Actions returned: ("add", StageRequest) and ("feed", rid, port, chunk, last).
    request_defaults: the stage's YAML `request_defaults`, under each request's own params."""

    def __init__(self, in_ports: dict[str, StreamSpec | None], request_defaults: dict[str, Any] | None = None):
        self.in_ports = in_ports
        self.request_defaults = dict(request_defaults or {})
        self.plain_ports = {p for p, s in in_ports.items() if s is None}
        self.stream_ports = {p for p, s in in_ports.items() if s is not None}
        self._requests: dict[str, _Assembly] = {}

    def num_waiting(self) -> int:
        return sum(1 for a in self._requests.values() if not a.added)

    def num_tracked(self) -> int:
        return len(self._requests)

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def deliver(
        self, rid: str, port: str | None, data: Any, has_data: bool, last: bool, meta: RequestMeta | None
    ) -> list[tuple]:
        a = self._requests.get(rid)
        if a is None:
            a = self._requests[rid] = _Assembly()
        if meta is not None:
            a.meta = meta
        actions: list[tuple] = []
        a.started = True
        if port is not None and port in self.stream_ports:
            rc = a.streams.get(port)
            if rc is None:
                rc = a.streams[port] = Rechunker(self.in_ports[port])
            for chunk, is_last in rc.push(data, has_data, last):
                if a.added:
                    actions.append(("feed", rid, port, chunk, is_last))
                else:
                    a.early_feeds.append((port, chunk, is_last))
            if last:
                a.closed.add(port)
        elif port is not None:
            if has_data:
                a.chunks.setdefault(port, []).append(data)
            if last:
                a.closed.add(port)
        if not a.added and self.plain_ports <= a.closed and a.meta is not None:
            inputs = {}
            for p in self.plain_ports:
                if p in a.chunks:
                    inputs[p] = combine_chunks(a.chunks[p])
            a.chunks.clear()
            a.added = True
            meta = a.meta
            actions.append(
                ("add", StageRequest(rid, inputs, {**self.request_defaults, **(meta.params or {})}, meta.deadline))
            )
            for p, chunk, is_last in a.early_feeds:
                actions.append(("feed", rid, p, chunk, is_last))
            a.early_feeds.clear()
        if a.added and self.stream_ports <= a.closed:
            del self._requests[rid]  # nothing more will arrive for it
        return actions
