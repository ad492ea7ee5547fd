"""SSE plumbing shared by the OpenAI routes: wait for a pipeline stream's first chunk before any
byte is sent (so a refusal at admission keeps its HTTP status), then frame events as SSE, report
a failure after the headers in-band in OpenAI's error shape, and end with `data: [DONE]`."""

from __future__ import annotations

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


def sse_stream(events: AsyncIterator[Any], stream: Any, *, done: bool = True) -> StreamingResponse:
    """Events (dicts, or (event_name, dict) pairs) as an SSE response; `stream` (the
    pipeline's) is closed however the response ends, which aborts unfinished work."""

    async def body():
        try:
            async for item in events:
                if isinstance(item, tuple):
                    yield sse_event(item[1], event=item[0])
                else:
                    yield sse_event(item)
        except OmnistageError as err:  # headers are gone: report the error in-band
            yield sse_event(error_event(err))
        finally:
            await stream.aclose()
        if done:
            yield SSE_DONE

    return StreamingResponse(body(), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
