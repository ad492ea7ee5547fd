"""The transcripts of spoken chat replies, by their `audio.id`, so that a later turn can send
the reply back as `{"role": "assistant", "audio": {"id": ...}}`, as OpenAI's multi-turn audio
conversations do.

The model's chat template takes an assistant turn as text, so the id stands for its transcript.
Entries live until the `expires_at` the reply announced, are kept per API key (another key's id
is unknown to this one, as another organisation's is at OpenAI) and are bounded in number: the
oldest go first (by count and by the transcripts' total size).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import HTTPConnection

from omnistage.serving.jobs.owners import owner_of

EXPIRES_S = 3600
MAX_REPLIES = 100_000
MAX_CHARS = 64 << 20  # of transcripts, all replies together


@dataclass(frozen=True)
class SpokenReply:
    transcript: str
    expires_at: float


class SpokenReplies:
    def __init__(self, max_replies: int = MAX_REPLIES, max_chars: int = MAX_CHARS, clock=time.time) -> None:
        self._replies: OrderedDict[tuple[str | None, str], SpokenReply] = OrderedDict()
        self._max = max_replies
        self._max_chars = max_chars
        self._chars = 0
        self._clock = clock
        self._lock = threading.Lock()  # remembered on the loop, looked up from a worker thread too

    def remember(self, owner: str | None, audio_id: str, transcript: str) -> int:
        """Keeps `transcript` under `audio_id`; returns its expires_at (whole seconds)."""
        expires_at = int(self._clock()) + EXPIRES_S
        with self._lock:
            self._drop((owner, audio_id))
            self._replies[(owner, audio_id)] = SpokenReply(transcript, expires_at)
            self._chars += len(transcript)
            # every entry lives as long, so the oldest are the first to expire
            while self._replies and (
                len(self._replies) > self._max
                or self._chars > self._max_chars
                or next(iter(self._replies.values())).expires_at <= self._clock()
            ):
                self._drop(next(iter(self._replies)))
        return expires_at

    def transcript(self, owner: str | None, audio_id: str) -> str | None:
        """The transcript of a reply this owner was given, None when unknown or expired."""
        with self._lock:
            reply = self._replies.get((owner, audio_id))
            if reply is not None and reply.expires_at <= self._clock():
                self._drop((owner, audio_id))
                reply = None
        return reply.transcript if reply is not None else None

    def _drop(self, key: tuple[str | None, str]) -> None:
        reply = self._replies.pop(key, None)
        if reply is not None:
            self._chars -= len(reply.transcript)


def remember_reply(connection: HTTPConnection, audio_id: str, transcript: str) -> int:
    return connection.app.state.spoken_replies.remember(owner_of(connection), audio_id, transcript)


def transcripts_for(connection: HTTPConnection) -> Callable[[str], str | None]:
    """The lookup of the connection's key's replies: audio id -> transcript (None: unknown)."""
    store, owner = connection.app.state.spoken_replies, owner_of(connection)
    return lambda audio_id: store.transcript(owner, audio_id)
