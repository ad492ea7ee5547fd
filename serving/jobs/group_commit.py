"""GroupCommitter: writes that arrive together are stored in one transaction.

A caller hands one item to `submit()` and awaits its result; `run()` takes everything pending
(at most `max_batch`), calls `write(batch)` (one transaction) and answers each caller with its
result once the transaction has committed. Whatever arrives while one batch is being written
goes into the next one, so under load one commit serves many callers. This is a group commit,
not fire-and-forget: an awaited submit returns only when its write is durable.

The write runs in a worker thread, so the event loop never waits on the database, or with
`inline` on the loop itself, for a store whose transactions are local and take about a
millisecond (SQLite): a thread's transaction gives the GIL up at each statement and, while the
loop is busy, waits up to the interpreter's switch interval (5 ms) to get it back, so under a
burst of submissions it took 6-13 ms instead of ~1 and held up every caller of its batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

log = logging.getLogger("omnistage.jobs")

INLINE_MAX_BATCH = 64  # an inline batch holds the event loop: a few milliseconds at most


class GroupCommitter(Generic[Item, Result]):
    def __init__(
        self,
        write: Callable[[list[Item]], list[Result]],
        max_batch: int = 256,  # so one batch never holds the write lock for long
        after: Callable[[list[Result]], None] | None = None,  # on the loop, after each committed batch
        inline: bool = False,  # write on the event loop instead of a worker thread
    ):
        self.write = write
        self.max_batch = min(max_batch, INLINE_MAX_BATCH) if inline else max_batch
        self.after = after
        self.inline = inline
        self._pending: list[tuple[Item, asyncio.Future]] = []
        self._ready = asyncio.Event()
        self.idle = asyncio.Event()  # set while nothing is pending or being written
        self.idle.set()

    async def submit(self, item: Item) -> Result:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        self._ready.set()
        self.idle.clear()
        return await future

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            if self.inline:
                await asyncio.sleep(0)  # the callers the loop has ready now join this batch
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            if not self._pending:
                self._ready.clear()
            items = [item for item, _ in batch]
            try:
                results = self.write(items) if self.inline else await asyncio.to_thread(self.write, items)
            except asyncio.CancelledError:
                for _, future in batch + self._pending:
                    future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - each waiting caller gets the store's error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                self._idle_if_drained()
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():  # the caller may have gone away
                    future.set_result(result)
            if self.after is not None:
                self.after(results)
            self._idle_if_drained()

    def _idle_if_drained(self) -> None:
        if not self._pending:
            self.idle.set()
