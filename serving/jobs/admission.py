"""SubmitBatcher: the submissions that arrive together are stored in one transaction.

A POST /v1/jobs hands its validated job to the batcher and awaits the result. The batcher
runs the store's `create_jobs` in a worker thread, so the event loop never waits on the
database, and everything submitted while one batch is being written goes into the next one:
under a burst, one commit (and one queue-position count per model) serves many requests.
"""

from __future__ import annotations

import asyncio

from omnistage.serving.jobs.model import Admitted, Job
from omnistage.serving.jobs.store import JobStore

MAX_BATCH = 256  # jobs per transaction, so one batch never holds the write lock for long


class SubmitBatcher:
    def __init__(self, store: JobStore, max_queued_per_owner: int | None):
        self.store = store
        self.max_queued_per_owner = max_queued_per_owner
        self._pending: list[tuple[Job, asyncio.Future]] = []
        self._ready = asyncio.Event()

    async def submit(self, job: Job) -> Admitted:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((job, future))
        self._ready.set()
        return await future

    async def run(self) -> None:
        while True:
            await self._ready.wait()
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            if not self._pending:
                self._ready.clear()
            try:
                results = await asyncio.to_thread(
                    self.store.create_jobs, [job for job, _ in batch], self.max_queued_per_owner
                )
            except asyncio.CancelledError:
                for _, future in batch + self._pending:
                    future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - each waiting request gets the store's error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results):
                if not future.done():  # the client may have gone away
                    future.set_result(result)
