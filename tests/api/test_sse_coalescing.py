"""How streamed chunks become SSE writes: Pipeline.stream_batches hands a reader every chunk
that arrived while it was away, in one list; serving/routes/streams.sse_stream writes each
list of events at once, byte for byte what one write per event sent; an error after the
headers is reported in-band; a client that leaves closes the pipeline stream."""

from __future__ import annotations

import asyncio

from omnistage.errors import InvalidRequestError
from omnistage.serving.routes.streams import one_per_batch, sse_stream
from omnistage.streaming.sse import SSE_DONE, sse_event


class Stream:
    """A pipeline-like stream of batches whose closing is recorded."""

    def __init__(self, batches, delay: float = 0.0):
        self.batches, self.delay, self.closed = batches, delay, False

    async def gen(self):
        try:
            for batch in self.batches:
                if self.delay:
                    await asyncio.sleep(self.delay)
                yield batch
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


def _frame(e) -> bytes:
    return sse_event(e[1], event=e[0]) if isinstance(e, tuple) else sse_event(e)


def test_each_batch_leaves_in_one_write_with_the_bytes_of_its_events():
    batches = [[{"i": i, "text": f"token {i}"} for i in range(b * 50, b * 50 + 50)] for b in range(4)]
    batches[-1].append(("named", {"last": True}))
    source = Stream(batches)
    writes = _writes(sse_stream(source.gen(), source))
    assert writes == [b"".join(map(_frame, batch)) for batch in batches] + [SSE_DONE]
    assert source.closed


def test_events_made_one_at_a_time_leave_one_write_each():
    events = [{"i": i} for i in range(5)]

    async def slow():
        for e in events:
            await asyncio.sleep(0.01)
            yield e

    source = Stream([])
    writes = _writes(sse_stream(one_per_batch(slow()), source, done=False))
    assert writes == [sse_event(e) for e in events]
    assert source.closed


def test_an_error_after_the_headers_is_reported_in_band():
    async def failing():
        yield [{"i": 0}]
        raise InvalidRequestError("bad seed", param="seed")

    source = Stream([])
    body = b"".join(_writes(sse_stream(failing(), source)))
    assert body.startswith(sse_event({"i": 0}))
    assert b'"param":"seed"' in body and body.endswith(SSE_DONE)


def test_a_client_that_leaves_closes_the_stream():
    source = Stream([[{"i": i}] for i in range(1000)], delay=0.001)
    writes = _writes(sse_stream(source.gen(), source), stop_after=1)
    assert len(writes) == 1 and source.closed


def test_a_reader_that_was_away_gets_what_arrived_meanwhile_in_one_batch(llm_pipeline):
    """The real tiny-llm pipeline: a reader that sleeps between reads gets several token
    chunks per batch, one that reads at once gets them as they come; the text is the same."""
    params = {"llm": {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}}

    async def read(pause: float) -> tuple[list[int], str]:
        sizes, text = [], ""
        async for batch in llm_pipeline.stream_batches({"prompt": "Once upon a time"}, params):
            sizes.append(sum(1 for c in batch if c.port == "text" and c.data))
            text += "".join(c.data for c in batch if c.port == "text" and c.data)
            await asyncio.sleep(pause)
        return sizes, text

    eager_sizes, eager_text = asyncio.run(read(0.0))
    slow_sizes, slow_text = asyncio.run(read(0.15))
    assert slow_text == eager_text and eager_text
    assert max(slow_sizes) > 1, slow_sizes
    assert len(slow_sizes) < len(eager_sizes), (slow_sizes, eager_sizes)


def test_spliced_content_events_are_the_encoded_events():
    from omnistage.serving.routes.streams import TEXT_SLOT, spliced_encoder

    def event(text):
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}

    splice = spliced_encoder(event(TEXT_SLOT))
    for text in ("hi", 'a"b\\c\nd\r', "é✓\u2028", "\x00x", ""):
        assert sse_event(splice(text)) == sse_event(event(text)), text
