"""Preemptive responses: with server VAD, the response to a turn starts in the stages after a
short pause in the user's speech (`OMNISTAGE_REALTIME_PREEMPTIVE_MS`, 64 ms: two silero frames)
instead of after `silence_duration_ms` of silence, so the thinker, talker and token2wav work
while the VAD waits to be sure the turn ended.

Nothing reaches the client early: the response's events (from `response.created` on) go out
only when the turn ends at that same silence, and the pipeline's output waits in the stream
until then. If the user speaks again first (or a client event arrives that could change the
answer: any but an audio append or an item retrieve), the request is aborted in every stage
and forgotten; the next pause starts another.
The prompt is the one the ended turn builds: the same conversation, plus the user's audio
from the speech start to the silence, which is exactly the audio that the stop commits.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

PREEMPTIVE_ENV = "OMNISTAGE_REALTIME_PREEMPTIVE_MS"
DEFAULT_PAUSE_MS = 64  # one silent frame is often a dip inside a word; two rarely are


def preemptive_pause_ms() -> int | None:
    """The silence (ms) after which a response starts early; None (the variable is "off"): never."""
    raw = os.environ.get(PREEMPTIVE_ENV, "").strip().lower()
    if raw in ("off", "none", "false"):
        return None
    if not raw:
        return DEFAULT_PAUSE_MS
    if not raw.isdecimal():
        raise ValueError(f"{PREEMPTIVE_ENV} must be milliseconds of silence (e.g. 64) or off, not {raw!r}")
    return int(raw)


class SubmittedStream:
    """A pipeline stream submitted now and read later: a task of its own starts the request and
    waits for its first chunk; the reader takes that chunk and then reads the stream itself.
    Until the reader comes, the chunks wait in the pipeline's queue under its credit window."""

    def __init__(self, stream: AsyncIterator[Any]):
        self._stream = stream
        self._first: asyncio.Task | None = asyncio.get_running_loop().create_task(self._first_chunk())

    async def _first_chunk(self) -> Any:
        return await self._stream.__anext__()

    def __aiter__(self) -> SubmittedStream:
        return self

    async def __anext__(self) -> Any:
        if self._first is not None:
            first, self._first = self._first, None
            return await first
        return await self._stream.__anext__()

    def failed(self) -> bool:
        """Whether the request already ended in an error (before anyone read it)."""
        first = self._first
        if first is None or not first.done() or first.cancelled():
            return False
        return not isinstance(first.exception(), (type(None), StopAsyncIteration))

    async def aclose(self) -> None:
        """Aborts the request in every stage (unless it ended)."""
        first, self._first = self._first, None
        if first is not None:
            first.cancel()
            await asyncio.wait({first})
            if not first.cancelled():
                first.exception()  # retrieved: an error of a request nobody will read is no news
        await self._stream.aclose()


@dataclass
class EarlyResponse:
    """A response started at a pause: valid for a stop whose audio is [start_ms, end_ms), on
    the same conversation and buffer (`context`), unless its request already failed (a
    refusal under load then is no reason to refuse the turn)."""

    runner: Any  # ResponseRunner
    start_ms: int
    end_ms: int
    context: tuple
    expiry: asyncio.TimerHandle

    def matches(self, start_ms: int, end_ms: int, context: tuple) -> bool:
        span = (self.start_ms, self.end_ms, self.context) == (start_ms, end_ms, context)
        return span and not self.runner.submit_failed()
