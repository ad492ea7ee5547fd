"""SSE plumbing shared by the OpenAI routes: wait for a pipeline stream's first chunk before any
byte is sent (so a refusal at admission keeps its HTTP status), then frame events as SSE, report
a failure after the headers in-band in OpenAI's error shape, and end with `data: [DONE]`."""

from __future__ import annotations

import asyncio
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
    """Awaits the stream's first chunk now (errors raise here, before the response starts);
    returns an iterator over that chunk and the rest."""
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
    Deltas of one encoder still queued when the writer comes round leave as one event with
    their texts joined: a stream whose server fell behind sends fewer, longer deltas instead
    of a backlog of one-token events, which keeps both ends' cost per token down."""

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
        elif part is not _END and not isinstance(part, BaseException):
            out.append(sse_event(part))
    if encode is not None:
        out.append(sse_event(encode("".join(texts))))
    return b"".join(out)


# Encoded events a stream may hold ahead of its client: beyond this the producer waits for the
# socket (backpressure), as when each event was written before the next was made.
COALESCE_MAX_EVENTS = 256
_END = object()


async def _encoded(events: AsyncIterator[Any], queue: asyncio.Queue) -> None:
    """Producer: every event (encoded by the writer), an in-band error event, or the
    exception, then _END."""
    try:
        async for item in events:
            await queue.put(item)
    except OmnistageError as err:  # headers are gone: report the error in-band
        await queue.put(error_event(err))
    except Exception as exc:  # noqa: BLE001 - re-raised by the consumer, in the response
        await queue.put(exc)
    await queue.put(_END)


def sse_stream(events: AsyncIterator[Any], stream: Any, *, done: bool = True) -> StreamingResponse:
    """Events (dicts, (event_name, dict) pairs, or TextDeltas) as an SSE response; `stream`
    (the pipeline's) is closed however the response ends, which aborts unfinished work.

    Events made while the previous write was under way leave together in one write (and
    their TextDeltas as one event): under load a response sends one chunk per wake-up of its
    task, not one per token."""

    async def body():
        queue: asyncio.Queue = asyncio.Queue(COALESCE_MAX_EVENTS)
        producer = asyncio.ensure_future(_encoded(events, queue))
        try:
            while True:
                parts = [await queue.get()]
                while not queue.empty():
                    parts.append(queue.get_nowait())
                failure = next((p for p in parts if isinstance(p, BaseException)), None)
                end = failure is not None or parts[-1] is _END
                data = _frames(parts)
                if end and failure is None and done:
                    data += SSE_DONE
                if data:
                    yield data
                if failure is not None:
                    raise failure
                if end:
                    return
        finally:
            producer.cancel()  # the client left, or the end: stop pulling, then close the stream
            try:
                await asyncio.wait({producer})
            finally:
                await stream.aclose()

    return StreamingResponse(body(), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
