"""SSE plumbing shared by the OpenAI routes: wait for a pipeline stream's first chunk before any
byte is sent (so a refusal at admission keeps its HTTP status), then frame events as SSE, report
a failure after the headers in-band in OpenAI's error shape, and end with `data: [DONE]`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
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


# Encoded events a stream may hold ahead of its client: beyond this the producer waits for the
# socket (backpressure), as when each event was written before the next was made.
COALESCE_MAX_EVENTS = 256
_END = object()


async def _encoded(events: AsyncIterator[Any], queue: asyncio.Queue) -> None:
    """Producer: every event encoded, an in-band error event, or the exception, then _END."""
    try:
        async for item in events:
            await queue.put(sse_event(item[1], event=item[0]) if isinstance(item, tuple) else sse_event(item))
    except OmnistageError as err:  # headers are gone: report the error in-band
        await queue.put(sse_event(error_event(err)))
    except Exception as exc:  # noqa: BLE001 - re-raised by the consumer, in the response
        await queue.put(exc)
    await queue.put(_END)


def sse_stream(events: AsyncIterator[Any], stream: Any, *, done: bool = True) -> StreamingResponse:
    """Events (dicts, or (event_name, dict) pairs) as an SSE response; `stream` (the
    pipeline's) is closed however the response ends, which aborts unfinished work.

    Events made while the previous write was under way leave together in one write: under
    load a response sends one chunk per wake-up of its task, not one per token."""

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
                data = b"".join(p for p in parts if isinstance(p, bytes))
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
