"""Background threads the runtime starts in a user's process.

They block SIGINT and SIGTERM. CPython runs signal handlers only in the main thread, and a main
thread asleep in an untimed wait (`Thread.join()`, `Event.wait()`) wakes only when the kernel
delivers the signal to it; a stop signal taken by a background thread leaves it asleep, and
Ctrl+C does nothing. With the runtime's threads blocking them, the kernel hands these signals to
a thread that can act on them.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def start_background_thread(target: Callable[..., Any], name: str, args: tuple = ()) -> threading.Thread:
    """Start a daemon thread running `target(*args)` that never receives SIGINT or SIGTERM."""
    thread = threading.Thread(target=target, name=name, args=args, daemon=True)
    start_without_stop_signals(thread)
    return thread


def start_without_stop_signals(thread: threading.Thread) -> None:
    """`thread.start()` with SIGINT and SIGTERM blocked in it (a new thread inherits the mask of
    the thread that starts it, so the mask is set around `start()`, not inside the thread)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
