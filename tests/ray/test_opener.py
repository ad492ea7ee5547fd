"""StageOpener's grouping rule: which `open` calls a stage's requests leave in.

The Serve handle is replaced by a recorder of the calls it is given (what the opener sends is
the subject here; tests/ray/test_serve.py runs the same opener against real Serve replicas).
No Ray is started by this module.
"""

from __future__ import annotations

import asyncio

import pytest

from omnistage.ray_serve.calls import OPEN_BATCH, StageOpener


class OpenRecorder:
    """`handle.open.remote(channel, requests)`: records each call; `release` answers them
    (the id of the replica, or an exception for the calls in `failing`)."""

    def __init__(self, failing: set[int] = frozenset()):
        self.calls: list[list[str]] = []
        self.failing = failing
        self.release = asyncio.Event()
        self.open = self

    def remote(self, channel: str, requests: list[tuple[str, list]]):
        index = len(self.calls)
        self.calls.append([rid for rid, _ in requests])

        async def answer():
            await self.release.wait()
            if index in self.failing:
                raise RuntimeError(f"call {index} failed")
            return f"replica-{index}"

        return answer()


def test_opens_of_one_turn_leave_together_in_calls_of_at_most_open_batch():
    async def main():
        handle = OpenRecorder()
        opener = StageOpener(handle, "channel")
        futures = [opener.open(f"r{i}", []) for i in range(OPEN_BATCH * 2 + 3)]
        await asyncio.sleep(0)  # one turn: the burst's calls leave
        later = opener.open("late", [])
        handle.release.set()
        pins = await asyncio.gather(*futures, later)
        return handle.calls, pins

    calls, pins = asyncio.run(main())
    assert [len(c) for c in calls] == [OPEN_BATCH, OPEN_BATCH, 3, 1]
    assert calls[0][0] == "r0" and calls[-1] == ["late"]
    # each request learns the replica of the call that carried it
    assert pins[:OPEN_BATCH] == ["replica-0"] * OPEN_BATCH
    assert pins[-1] == "replica-3"


def test_a_failed_call_fails_only_its_own_requests():
    async def main():
        handle = OpenRecorder(failing={1})
        opener = StageOpener(handle, "channel")
        futures = [opener.open(f"r{i}", []) for i in range(OPEN_BATCH + 2)]
        handle.release.set()
        return await asyncio.gather(*futures, return_exceptions=True)

    results = asyncio.run(main())
    assert results[:OPEN_BATCH] == ["replica-0"] * OPEN_BATCH
    assert all(isinstance(r, RuntimeError) and "call 1 failed" in str(r) for r in results[OPEN_BATCH:])


def test_an_open_withdrawn_before_its_call_leaves_is_never_sent():
    async def main():
        handle = OpenRecorder()
        opener = StageOpener(handle, "channel")
        kept, dropped = opener.open("kept", []), opener.open("dropped", [])
        assert opener.withdraw("dropped") is True
        handle.release.set()
        assert await kept == "replica-0"
        with pytest.raises(asyncio.CancelledError):
            await dropped
        assert opener.withdraw("kept") is False  # already sent: the caller aborts it instead
        return handle.calls

    assert asyncio.run(main()) == [["kept"]]
