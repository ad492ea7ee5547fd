"""Streamed text deltas that arrive together (in one batch) leave as one event
(serving/routes/streams.py TextDelta): a server that fell behind sends fewer, longer deltas.
The joined text is always the same; other events keep their place; a stream whose server
keeps up (a delta per batch) sends one event per delta. Against a real server, 32 concurrent streams read with the
official `openai` client each join to the text of the same request answered unstreamed."""

from __future__ import annotations

import asyncio
import json

from omnistage.serving.routes.streams import TEXT_SLOT, TextDelta, spliced_encoder, sse_stream
from omnistage.streaming.sse import SSE_DONE, sse_event


def _event(text: str, index: int = 0) -> dict:
    choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}


class Source:
    """A pipeline-like stream (closing recorded) producing batches of `items` (`per_batch` to
    a batch; all in one by default), optionally with a pause before each."""

    def __init__(self, items, delay: float = 0.0, per_batch: int | None = None):
        self.items, self.delay, self.closed = items, delay, False
        self.per_batch = per_batch or max(1, len(items))

    async def gen(self):
        for start in range(0, len(self.items), self.per_batch):
            if self.delay:
                await asyncio.sleep(self.delay)
            yield self.items[start : start + self.per_batch]

    async def aclose(self):
        self.closed = True


def _events(items, delay: float = 0.0, per_batch: int | None = None) -> tuple[list[bytes], list[dict], Source]:
    """(the response's writes, its events decoded, the source)."""
    source = Source(items, delay, per_batch)
    response = sse_stream(source.gen(), source)

    async def collect():
        return [chunk async for chunk in response.body_iterator]

    writes = asyncio.run(collect())
    body = b"".join(writes)
    assert body.endswith(SSE_DONE)
    frames = body[: -len(SSE_DONE)].decode().split("\n\n")[:-1]
    data = [next(line for line in f.split("\n") if line.startswith("data: ")) for f in frames]
    return writes, [json.loads(d.removeprefix("data: ")) for d in data], source


def test_queued_deltas_leave_as_one_event_with_their_texts_joined():
    encode = spliced_encoder(_event(TEXT_SLOT))
    texts = [f"tok{i} " for i in range(50)] + ['"q\\\n', "é✓"]
    writes, events, source = _events([TextDelta(t, encode) for t in texts])
    assert events == [_event("".join(texts))]  # arrived together: one event
    assert writes == [sse_event(_event("".join(texts))), SSE_DONE]
    assert source.closed


def test_other_events_keep_their_place_and_split_the_runs():
    first, second = spliced_encoder(_event(TEXT_SLOT)), spliced_encoder(_event(TEXT_SLOT, index=1))
    items = [
        {"role": "start"},
        TextDelta("a", first),
        TextDelta("b", first),
        TextDelta("x", second),  # another choice's encoder: not merged with choice 0
        TextDelta("c", first),
        ("named", {"mid": True}),
        TextDelta("d", first),
        TextDelta("e", first),
        {"usage": 1},
    ]
    _, events, _ = _events(items)
    assert events == [
        {"role": "start"},
        _event("ab"),
        _event("x", index=1),
        _event("c"),
        {"mid": True},  # the named event's data (its `event:` line is not data)
        _event("de"),
        {"usage": 1},
    ]


def test_a_server_that_keeps_up_sends_one_event_per_delta():
    encode = spliced_encoder(_event(TEXT_SLOT))
    texts = ["one", " two", " three", " four"]
    writes, events, _ = _events([TextDelta(t, encode) for t in texts], delay=0.02, per_batch=1)
    assert events == [_event(t) for t in texts]
    assert writes == [sse_event(_event(t)) for t in texts] + [SSE_DONE]


def test_concurrent_streams_join_to_the_unstreamed_text(tiny_server):
    """32 streams at once (the server's loop may fall behind and merge deltas, or not: the
    texts must be the same either way), each against the same request answered unstreamed
    (a path without SSE)."""
    import openai

    prompts = [f"Count to {n}." for n in range(4)]
    params = {"temperature": 0.0, "max_tokens": 16}
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0) as client:
        reference = [
            client.chat.completions.create(
                model="tiny-llm", messages=[{"role": "user", "content": p}], extra_body={"ignore_eos": True}, **params
            )
            .choices[0]
            .message.content
            for p in prompts
        ]

    async def one(client, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model="tiny-llm",
            messages=[{"role": "user", "content": prompts[i % 4]}],
            stream=True,
            extra_body={"ignore_eos": True},
            **params,
        )
        parts = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
        return "".join(parts), len(parts)

    async def all_streams():
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(all_streams())
    for i, (text, deltas) in enumerate(results):
        assert text == reference[i % 4], i
        assert 1 <= deltas <= 16
