"""SSE framing, judged by the official openai client's SSE decoder."""

import json

from openai._streaming import SSEDecoder

from omnistage.streaming.sse import SSE_DONE, sse_comment, sse_event


def _parse(raw: bytes, split: int = 7):
    # Feed the bytes in small pieces, as a network would deliver them.
    pieces = [raw[i : i + split] for i in range(0, len(raw), split)]
    return list(SSEDecoder().iter_bytes(iter(pieces)))


def test_json_events_multiline_and_done():
    payloads = [{"id": "c1", "choices": [{"delta": {"content": "héllo\nworld"}}]}, "line1\nline2"]
    raw = sse_event(payloads[0]) + sse_comment("ping") + sse_event(payloads[1], event="text", id="7") + SSE_DONE
    events = _parse(raw)
    assert len(events) == 3
    assert json.loads(events[0].data) == payloads[0]
    assert events[1].event == "text" and events[1].id == "7" and events[1].data == "line1\nline2"
    assert events[2].data == "[DONE]"
