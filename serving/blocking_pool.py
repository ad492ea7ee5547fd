"""The server's pool for blocking calls (`asyncio.to_thread`, `run_in_executor(None, ...)`).

Its threads all start with the server instead of one by one under load: the server's thread
count is then fixed once it serves, so a thread that leaks shows as growth (`omnistage bench
soak`), and the first burst of job submissions does not pay for thread creation.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor

THREAD_PREFIX = "omnistage-blocking"


def pool_size() -> int:
    """The size asyncio's own default executor would have."""
    return min(32, (os.cpu_count() or 1) + 4)


async def install_blocking_pool(size: int | None = None) -> ThreadPoolExecutor:
    """Make a pool of `size` started threads the running loop's default executor."""
    size = size or pool_size()
    pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix=THREAD_PREFIX)
    # a pool starts a thread per task while none is idle: `size` tasks that wait for each other
    # start all of them
    everyone = threading.Barrier(size)
    await asyncio.gather(*(asyncio.wrap_future(pool.submit(everyone.wait, 10)) for _ in range(size)))
    asyncio.get_running_loop().set_default_executor(pool)
    return pool
