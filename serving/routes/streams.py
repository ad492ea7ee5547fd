"""SSE plumbing shared by the OpenAI routes: wait for a pipeline stream's first batch of chunks
before any byte is sent (so a refusal at admission keeps its HTTP status), then frame each batch
of events as one SSE write, report a failure after the headers in-band in OpenAI's error shape,
and end with `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from omnistage.errors import OmnistageError
from omnistage.serving.deps import unless_disconnected
from omnistage.serving.errors import error_body
from omnistage.streaming.sse import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, sse_event


async def first_then_rest(request: Request, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Awaits the stream's first item (a chunk, or a batch of them) now: errors raise here,
    before the response starts. Returns an iterator over that item and the rest."""
    try:
        first = await unless_disconnected(request, anext(stream))
    except StopAsyncIteration:
        first = None

    async def chained():
        if first is None:
            return
        yield first
        async for item in stream:
            yield item

    return chained()


def error_event(err: OmnistageError) -> dict[str, Any]:
    return error_body(str(err), status=err.status, code=err.code, param=getattr(err, "param", None))


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A streamed text delta and how its event is encoded (`encode(text)` -> the event's JSON).
    Adjacent deltas of one encoder in a batch leave as one event with their texts joined: a
    stream whose server fell behind sends fewer, longer deltas instead of a backlog of
    one-token events, which keeps both ends' cost per token down."""

    text: str
    encode: Callable[[str], str]


TEXT_SLOT = "\x00"


def spliced_encoder(event: dict[str, Any]) -> Callable[[str], str]:
    """An encoder for TextDelta: `event` with TEXT_SLOT where the text goes, encoded once; each
    call splices the JSON string of its text in (the bytes json.dumps gives for the event)."""
    head, tail = json.dumps(event, separators=(",", ":"), ensure_ascii=False).split('"\\u0000"')
    return lambda text: head + json.dumps(text, ensure_ascii=False) + tail


def _frames(parts: list[Any]) -> bytes:
    """The SSE bytes of queued events, adjacent TextDeltas of one encoder merged."""
    out: list[bytes] = []
    texts: list[str] = []
    encode = None
    for part in parts:
        if isinstance(part, TextDelta) and (encode is None or part.encode is encode):
            encode = part.encode
            texts.append(part.text)
            continue
        if encode is not None:
            out.append(sse_event(encode("".join(texts))))
            texts, encode = [], None
        if isinstance(part, TextDelta):
            encode, texts = part.encode, [part.text]
        elif isinstance(part, tuple):
            out.append(sse_event(part[1], event=part[0]))
        else:
            out.append(sse_event(part))
    if encode is not None:
        out.append(sse_event(encode("".join(texts))))
    return b"".join(out)


async def one_per_batch(events: AsyncIterator[Any]) -> AsyncIterator[list[Any]]:
    """Events made one at a time as sse_stream's batches (a write each)."""
    try:
        async for event in events:
            yield [event]
    finally:
        await events.aclose()


def sse_stream(batches: AsyncIterator[list[Any]], stream: Any, *, done: bool = True) -> StreamingResponse:
    """Batches of events (dicts, (event_name, dict) pairs, or TextDeltas) as an SSE response, a
    write per batch; `stream` (the pipeline's) is closed however the response ends, which
    aborts unfinished work.

    A route makes a batch of the chunks Pipeline.stream_batches handed it together: whatever
    arrived while the previous write was under way leaves in one write (and its TextDeltas
    as one event), so under load a response sends one chunk per wake-up of its task, not one
    per token, and the task that reads the pipeline is the one that writes."""

    async def body():
        try:
            try:
                async for events in batches:
                    data = _frames(events)
                    if data:
                        yield data
            except OmnistageError as err:  # headers are gone: report the error in-band
                yield _frames([error_event(err)])
            if done:
                yield SSE_DONE
        finally:  # the end, or the client left: stop reading, then close the stream
            try:
                await batches.aclose()
            finally:
                await stream.aclose()

    return StreamingResponse(body(), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
