"""The store behind `audio: {id}`: transcripts kept per API key, until their expires_at, and
bounded in number."""

from __future__ import annotations

from omnistage.serving.routes.spoken_replies import EXPIRES_S, SpokenReplies


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def test_a_reply_is_known_to_its_key_until_it_expires():
    clock = Clock()
    store = SpokenReplies(clock=clock)
    expires_at = store.remember("key-a", "audio-1", "hello there")
    assert expires_at == int(clock.t) + EXPIRES_S
    assert store.transcript("key-a", "audio-1") == "hello there"
    assert store.transcript("key-b", "audio-1") is None  # another key's id is unknown to it
    assert store.transcript(None, "audio-1") is None
    clock.t = expires_at - 1
    assert store.transcript("key-a", "audio-1") == "hello there"
    clock.t = expires_at
    assert store.transcript("key-a", "audio-1") is None


def test_the_oldest_replies_go_first():
    clock = Clock()
    store = SpokenReplies(max_replies=3, clock=clock)
    for i in range(5):
        store.remember(None, f"audio-{i}", str(i))
    assert [store.transcript(None, f"audio-{i}") for i in range(5)] == [None, None, "2", "3", "4"]
    clock.t += EXPIRES_S  # expired ones are dropped as new ones come
    store.remember(None, "audio-5", "5")
    assert len(store._replies) == 1


def test_transcripts_fit_a_size_budget():
    store = SpokenReplies(max_chars=10)
    store.remember(None, "audio-1", "abcd")
    store.remember(None, "audio-2", "efgh")
    store.remember(None, "audio-3", "ijkl")  # 12 characters: the oldest goes
    assert [store.transcript(None, f"audio-{i}") for i in (1, 2, 3)] == [None, "efgh", "ijkl"]
    store.remember(None, "audio-2", "xy")  # the same id again counts once
    assert store._chars == 6
