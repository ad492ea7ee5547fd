"""Worker health: a watchdog on engine steps that never return, and memory recycling.

Step watchdog: each worker stamps a shared clock (`StepClock`, one double in shared memory)
with `time.monotonic()` when an engine step begins and clears it when the step returns. The
hub reads every clock on each pass of its loop (at least twice a second); a step older than
the stage's `pool.step_timeout_s` means the engine is stuck (a deadlock, a kernel that never
returns, a GIL held forever), so the hub kills the process with SIGKILL. The ordinary death
path then fails exactly the requests it held (WorkerDiedError, retryable) and restarts it.
The check lives in the parent because a hung process cannot be trusted to report itself.

Memory recycling: a worker whose resident set passes `pool.max_rss` sends `OverMemory` once.
The hub then drains it: requests it already holds finish there, new ones wait for the next
generation (their deliveries are held, as during a restart, or go to another ready replica);
once it holds none of the old requests it gets Shutdown, exits cleanly and is restarted.
Nothing fails: a slow leak becomes a restart between requests instead of an OOM kill.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

from omnistage.runtime.messages import OverMemory, Shutdown, send_msg

log = logging.getLogger("omnistage.runtime")

MEMORY_CHECK_EVERY_S = 0.2
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class StepClock:
    """When the current engine step began (monotonic seconds, shared with the hub); 0: idle.
    CLOCK_MONOTONIC is one clock for every process on the machine."""

    def __init__(self, ctx):
        self.value = ctx.RawValue("d", 0.0)

    def begin(self) -> None:
        self.value.value = time.monotonic()

    def end(self) -> None:
        self.value.value = 0.0

    def running_for(self) -> float:
        started = self.value.value
        return time.monotonic() - started if started > 0.0 else 0.0


class MemoryWatch:
    """Worker side: reports once when the process's RSS passes `limit` bytes. Checks at most
    every MEMORY_CHECK_EVERY_S; a check skipped for that is owed, so a worker that goes idle
    right after the work that took it over the limit still reports it (`bound_wait`)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.next_check = 0.0
        self.reported = False
        self.owed = False

    def check(self, send) -> None:
        if self.limit is None or self.reported:
            return
        now = time.monotonic()
        if now < self.next_check:
            self.owed = True
            return
        self.next_check = now + MEMORY_CHECK_EVERY_S
        self.owed = False
        rss = rss_bytes()
        if rss > self.limit:
            self.reported = True
            send(OverMemory(rss))

    def bound_wait(self, timeout: float | None) -> float | None:
        """An idle worker's wait (None: until a message), shortened to when an owed check may run."""
        if not self.owed or self.reported:
            return timeout
        due = max(0.0, self.next_check - time.monotonic())
        return due if timeout is None else min(timeout, due)


@dataclass
class Health:
    """Per replica generation: why the hub ended it (None: it died on its own)."""

    killed_for: str | None = None  # "hung": the watchdog's SIGKILL, with its reason
    draining: bool = False  # over max_rss: holds its current requests, gets no new ones
    keep: frozenset = frozenset()  # the requests it finishes before the restart
    recycled: bool = False  # Shutdown sent after draining: its exit is a planned restart


def check_steps(replicas, spec) -> None:
    """Kill every ready worker whose current engine step has run past its stage's timeout."""
    for r in replicas:
        timeout = spec.stages[r.stage].pool.step_timeout_s
        if not r.ready or timeout is None or r.step_clock is None or r.health.killed_for:
            continue
        ran = r.step_clock.running_for()
        if ran > timeout:
            r.health.killed_for = (
                f"killed by the watchdog: an engine step ran {ran:.1f}s, over pool.step_timeout_s={timeout:g}"
            )
            log.warning("omnistage: %s (pid %s) %s", r.name, r.pid, r.health.killed_for)
            try:
                os.kill(r.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_drain(r, rss: int) -> None:
    """`r` passed its memory limit: finish what it holds, take nothing new."""
    if r.health.draining or not r.ready:
        return
    log.warning("omnistage: %s (pid %s) uses %d MiB, over pool.max_rss: recycling it", r.name, r.pid, rss >> 20)
    r.health.draining = True
    r.health.keep = frozenset(r.requests)


def finish_drains(replicas) -> None:
    """Send Shutdown to every draining worker whose old requests have all finished."""
    for r in replicas:
        h = r.health
        if h.draining and not h.recycled and r.ready and not (h.keep & r.requests):
            h.recycled = True
            try:
                send_msg(r.conn, Shutdown())
            except OSError:
                pass


def holds_back(r, msg) -> bool:
    """Whether a message for `r` must wait for its next generation: a draining worker gets
    only what belongs to the requests it is finishing."""
    rid = getattr(msg, "request_id", None)
    return r.health.draining and rid is not None and rid not in r.health.keep
