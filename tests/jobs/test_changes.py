"""ChangeSignal: every waiter wakes on a notify, and a change notified between a reader's mark
and its wait is not lost."""

from __future__ import annotations

import asyncio
import time

from omnistage.serving.jobs.changes import ChangeSignal


def test_a_change_after_the_mark_wakes_the_wait_at_once():
    async def run():
        signal = ChangeSignal()
        mark = signal.mark()
        signal.notify()  # between the reader's read and its wait
        t0 = time.perf_counter()
        woke = await signal.wait(5.0, mark)
        return woke, time.perf_counter() - t0, await signal.wait(0.05, signal.mark())

    woke, waited, later = asyncio.run(run())
    assert woke and waited < 1.0
    assert later is False  # the next mark waits for the next change


def test_one_notify_wakes_every_waiter_and_a_quiet_wait_times_out():
    async def run():
        signal = ChangeSignal()
        waiters = [asyncio.create_task(signal.wait(5.0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        signal.notify()
        return await asyncio.gather(*waiters), await signal.wait(0.05)

    woken, quiet = asyncio.run(run())
    assert woken == [True, True, True]
    assert quiet is False
