"""Server-sent events framing (text/event-stream), as OpenAI streaming responses use it."""

from __future__ import annotations

import json
from typing import Any

SSE_MEDIA_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"
# Headers that keep proxies from buffering the stream.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(data: Any, *, event: str | None = None, id: str | None = None, retry_ms: int | None = None) -> bytes:
    """One event. `data` that is not str/bytes is sent as compact JSON; multi-line data
    becomes several `data:` lines (the client joins them with newlines)."""
    if isinstance(data, bytes):
        text = data.decode("utf-8")
    elif isinstance(data, str):
        text = data
    else:
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    lines = []
    if event is not None:
        _check_field("event", event)
        lines.append(f"event: {event}")
    if id is not None:
        _check_field("id", id)
        lines.append(f"id: {id}")
    if retry_ms is not None:
        lines.append(f"retry: {int(retry_ms)}")
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        lines.append(f"data: {line}")
    return ("\n".join(lines) + "\n\n").encode("utf-8")


def sse_comment(text: str = "") -> bytes:
    """A comment line (ignored by clients): a keep-alive ping."""
    return f": {text}\n\n".encode()


def _check_field(name: str, value: str) -> None:
    if "\n" in value or "\r" in value:
        raise ValueError(f"SSE {name} must be a single line")
