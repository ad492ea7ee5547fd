"""ChangeSignal: wakes every task waiting for the store's next change.

`notify()` is synchronous and creates no task (a burst of submissions notifies once per job).
A reader takes `mark()` before it reads the store and waits on that mark afterwards, so a
change notified between its read and its wait wakes it at once.
"""

from __future__ import annotations

import asyncio


class ChangeSignal:
    def __init__(self):
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def mark(self) -> asyncio.Event:
        """The next change's event, taken before a read of what it may change."""
        return self._event

    async def wait(self, timeout: float, mark: asyncio.Event | None = None) -> bool:
        """True when a change came (since `mark`, or from now) within `timeout` seconds."""
        event = mark if mark is not None else self._event
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return False
        return True
