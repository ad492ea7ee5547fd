"""The runtime's threads in a user's process leave Ctrl+C to the main thread: CPython acts on a
signal only in the main thread, and one that a background thread takes never wakes a main thread
asleep in `Thread.join()` (the Python-API program of tests/reliability/test_shutdown_signals.py
hung that way once in ~20 runs)."""

from __future__ import annotations

import signal
import threading


def blocked_signals(native_id: int) -> set[int]:
    with open(f"/proc/self/task/{native_id}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_the_hub_thread_blocks_stop_signals_and_the_main_thread_does_not(diamond):
    hubs = [t for t in threading.enumerate() if t.name.startswith("omnistage-hub-")]
    assert hubs, [t.name for t in threading.enumerate()]
    for hub in hubs:
        assert {signal.SIGINT, signal.SIGTERM} <= blocked_signals(hub.native_id), hub.name
    main = blocked_signals(threading.main_thread().native_id)
    assert signal.SIGINT not in main and signal.SIGTERM not in main
