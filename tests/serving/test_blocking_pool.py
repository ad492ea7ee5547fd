"""The server's blocking-call pool has all its threads once installed, and to_thread uses it."""

from __future__ import annotations

import asyncio
import threading

from omnistage.serving.blocking_pool import THREAD_PREFIX, install_blocking_pool


def pool_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def test_the_pool_starts_every_thread_before_any_call_and_serves_to_thread():
    async def main():
        pool = await install_blocking_pool(5)
        started = len(pool_threads())
        ran_on = await asyncio.gather(*(asyncio.to_thread(lambda: threading.current_thread().name) for _ in range(20)))
        after = len(pool_threads())
        pool.shutdown()
        return started, set(ran_on), after

    started, ran_on, after = asyncio.run(main())
    assert started == after == 5
    assert all(name.startswith(THREAD_PREFIX) for name in ran_on), ran_on
