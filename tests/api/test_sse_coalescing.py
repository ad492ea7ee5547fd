"""serving/routes/streams.sse_stream: events made while a write is under way leave in one
write, byte for byte what one write per event sent; a slow producer still gets one write per
event; a client that leaves closes the pipeline stream."""

from __future__ import annotations

import asyncio

from omnistage.errors import InvalidRequestError
from omnistage.serving.routes.streams import sse_stream
from omnistage.streaming.sse import SSE_DONE, sse_event


class Stream:
    """A pipeline-like stream: an async generator whose closing is recorded."""

    def __init__(self, items, delay: float = 0.0):
        self.items, self.delay, self.closed = items, delay, False

    async def gen(self):
        try:
            for item in self.items:
                if self.delay:
                    await asyncio.sleep(self.delay)
                yield item
        finally:
            self.closed = True

    async def aclose(self):
        self.closed = True


def _writes(response, stop_after: int | None = None) -> list[bytes]:
    async def collect():
        out = []
        async for chunk in response.body_iterator:
            out.append(chunk)
            if stop_after is not None and len(out) >= stop_after:
                await response.body_iterator.aclose()
                break
        return out

    return asyncio.run(collect())


def test_a_burst_leaves_in_few_writes_with_the_same_bytes():
    events = [{"i": i, "text": f"token {i}"} for i in range(200)] + [("named", {"last": True})]
    source = Stream(events)
    writes = _writes(sse_stream(source.gen(), source))
    expected = b"".join(sse_event(e[1], event=e[0]) if isinstance(e, tuple) else sse_event(e) for e in events)
    assert b"".join(writes) == expected + SSE_DONE
    assert len(writes) < len(events) / 10, len(writes)  # one per write, not per event
    assert source.closed


def test_a_slow_producer_gets_one_write_per_event():
    events = [{"i": i} for i in range(5)]
    source = Stream(events, delay=0.02)
    writes = _writes(sse_stream(source.gen(), source))
    assert writes[:4] == [sse_event(e) for e in events[:4]]
    assert writes[4] == sse_event(events[4]) + SSE_DONE


def test_an_error_after_the_headers_is_reported_in_band():
    async def failing():
        yield {"i": 0}
        raise InvalidRequestError("bad seed", param="seed")

    source = Stream([])
    body = b"".join(_writes(sse_stream(failing(), source)))
    assert body.startswith(sse_event({"i": 0}))
    assert b'"param":"seed"' in body and body.endswith(SSE_DONE)


def test_a_client_that_leaves_closes_the_stream():
    source = Stream([{"i": i} for i in range(1000)], delay=0.001)
    writes = _writes(sse_stream(source.gen(), source), stop_after=1)
    assert len(writes) == 1 and source.closed


def test_spliced_content_events_are_the_encoded_events():
    from omnistage.serving.routes.streams import TEXT_SLOT, spliced_encoder

    def event(text):
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}

    splice = spliced_encoder(event(TEXT_SLOT))
    for text in ("hi", 'a"b\\c\nd\r', "é✓\u2028", "\x00x", ""):
        assert sse_event(splice(text)) == sse_event(event(text)), text
