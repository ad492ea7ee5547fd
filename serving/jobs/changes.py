"""ChangeSignal: wakes every task waiting for the store's next change.

`notify()` is synchronous and creates no task (a burst of submissions notifies once per job);
a waiter that times out reads the store again anyway, so a notification that falls between
its read and its wait costs at most one timeout.
"""

from __future__ import annotations

import asyncio


class ChangeSignal:
    def __init__(self):
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> bool:
        """True when a change came within `timeout` seconds."""
        event = self._event
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            return False
        return True
