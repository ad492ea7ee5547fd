"""Stage replicas: their state, and the worker processes that host them.

A replica is one copy of one stage, hosted by one worker process at a time; when that process
dies the replica gets a new one (a new generation). Its life is a small state machine:

    STARTING --Ready--> READY --death--> RESTARTING --Ready--> READY ...
       |                                    |
       +--start failure--> FAILED           +--MAX_RESTART_FAILURES deaths before Ready--> DEAD
    (any live state) --pipeline closed--> STOPPED

FAILED (the first start failed) is kept apart from DEAD (restarts gave up): a first-start
failure is reported by `wait_ready` and never retried, while a replica that once served is
restarted until it keeps failing. The orchestrator drives the transitions (it sees the
messages and the deaths); this module owns the state, process start-up and shutdown.
"""

from __future__ import annotations

import enum
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from omnistage.graph.spec import PipelineSpec
from omnistage.runtime.fork_server import mp_context, without_main_reimport
from omnistage.runtime.messages import Shutdown, send_msg
from omnistage.runtime.watchdog import Health, StepClock
from omnistage.runtime.worker import WorkerConfig, worker_main

# per-request credit on streaming edges (runtime/credit.py); "0" turns it off
STREAM_CREDIT_ENV = "OMNISTAGE_STREAM_CREDIT"

MAX_RESTART_FAILURES = 3
# close(): a replica still building its engine gets this long to act on Shutdown, then SIGKILL
STARTING_STOP_GRACE_S = 1.0
# close(): how long live workers get to drain and exit before they are killed
STOP_JOIN_S = 5.0


class ReplicaState(enum.Enum):
    STARTING = "starting"  # first process building its engine
    READY = "ready"  # serving
    RESTARTING = "restarting"  # a later process building its engine after a death
    FAILED = "failed"  # the first start failed: reported, not retried
    DEAD = "dead"  # restarts kept failing: given up
    STOPPED = "stopped"  # the pipeline closed


class AfterDeath(enum.Enum):
    """What the orchestrator does once a replica's process has died."""

    RESTART = "restart"
    START_FAILED = "start_failed"  # wait_ready reports it
    GIVE_UP = "give_up"  # fail what waits for it; requests routed to it fail at once


@dataclass(eq=False)
class Replica:
    stage: str
    index: int
    device: str
    generation: int = 0
    state: ReplicaState = ReplicaState.STARTING
    error: str | None = None  # why the current or last process did not start
    restart_failures: int = 0  # deaths before Ready since it last served
    restarts: int = 0
    proc: Any = None
    conn: Any = None
    pid: int | None = None
    pending: list = field(default_factory=list)  # messages held while the worker starts
    requests: set = field(default_factory=set)  # request ids routed here, not finished here
    routed: int = 0  # requests routed here so far: breaks ties between equally loaded replicas
    last_stats: dict = field(default_factory=dict)
    step_clock: StepClock | None = None  # the current process's step start (the watchdog reads it)
    health: Health = field(default_factory=Health)  # the current process's watchdog / recycle state
    recycles: int = 0  # restarts for memory (pool.max_rss), also counted in `restarts`

    @property
    def name(self) -> str:
        return f"{self.stage}[{self.index}]"

    @property
    def ready(self) -> bool:
        return self.state is ReplicaState.READY

    @property
    def start_failed(self) -> bool:
        return self.state is ReplicaState.FAILED

    def mark_ready(self, pid: int) -> None:
        self.state = ReplicaState.READY
        self.error = None
        self.restart_failures = 0
        self.pid = pid

    def mark_start_error(self, error: str) -> None:
        """The worker reported that building its engine failed (its process exits next)."""
        self.error = error
        if self.state is ReplicaState.STARTING:
            self.state = ReplicaState.FAILED

    def mark_down(self) -> bool:
        """Its process died: nothing is sent to it any more (messages wait in `pending`).
        Returns whether it was serving."""
        was_ready = self.state is ReplicaState.READY
        if was_ready:
            self.state = ReplicaState.RESTARTING
        return was_ready

    def after_death(self, how: str, was_ready: bool) -> AfterDeath:
        """The state transition for a death while the pipeline runs (after `mark_down`)."""
        if was_ready:
            return AfterDeath.RESTART
        if self.error is None:
            self.error = f"worker process exited during start-up ({how})"
        if self.state in (ReplicaState.STARTING, ReplicaState.FAILED):
            self.state = ReplicaState.FAILED
            return AfterDeath.START_FAILED
        self.restart_failures += 1
        if self.restart_failures > MAX_RESTART_FAILURES:
            self.state = ReplicaState.DEAD
            return AfterDeath.GIVE_UP
        return AfterDeath.RESTART

    def begin_restart(self) -> None:
        """A new process (the next generation) is about to replace the dead one. After a
        planned recycle the held messages are kept: they belong to live requests."""
        if self.health.recycled:
            self.recycles += 1
        else:
            self.pending.clear()
        self.health = Health()
        self.generation += 1
        self.restarts += 1
        self.state = ReplicaState.RESTARTING

    def give_up(self, error: str) -> None:
        self.state = ReplicaState.DEAD
        self.error = error

    def close_conn(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
            self.conn = None


def exit_description(proc) -> str:
    """How a worker process ended, for error messages ("killed by SIGKILL", "exit code 1")."""
    proc.join(timeout=1)
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerProcesses:
    """Starts and stops the worker processes of one pipeline's replicas."""

    def __init__(self, spec: PipelineSpec, shm_prefix: str):
        self.spec = spec
        self.shm_prefix = shm_prefix
        self.ctx = None
        # per-request credit on streaming edges, for every worker of this pipeline (docs/runtime.md)
        self.stream_credit = os.environ.get(STREAM_CREDIT_ENV, "1") != "0"

    def open(self):
        self.ctx = mp_context()
        return self.ctx

    def spawn(self, r: Replica, permits: dict[int, Any]) -> None:
        """Start a process for the replica's current generation (state is the caller's)."""
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        r.step_clock = StepClock(self.ctx)
        cfg = WorkerConfig(self.spec, r.stage, r.index, r.device, self.shm_prefix, permits, r.generation)
        cfg.step_clock = r.step_clock
        cfg.stream_credit = self.stream_credit
        proc = self.ctx.Process(
            target=worker_main, args=(cfg, child_conn), name=f"omnistage:{self.spec.name}:{r.name}", daemon=True
        )
        with without_main_reimport():
            proc.start()
        child_conn.close()
        r.proc, r.conn, r.pid = proc, parent_conn, proc.pid

    @staticmethod
    def request_shutdown(replicas: list[Replica]) -> list[Replica]:
        """Send Shutdown to every replica with a process; return those still building their
        engine (they exit on it at once, having no request to drain)."""
        starting = []
        for r in replicas:
            if r.conn is not None:
                try:
                    send_msg(r.conn, Shutdown())
                except OSError:
                    pass
                if not r.ready:
                    starting.append(r)
        return starting

    @staticmethod
    def stop_starting(starting: list[Replica]) -> None:
        """Loading weights can take minutes and a starting replica holds no request: give it a
        moment to act on Shutdown, then kill it rather than wait."""
        grace_end = time.monotonic() + STARTING_STOP_GRACE_S
        for r in starting:
            r.proc.join(timeout=max(0.0, grace_end - time.monotonic()))
        for r in starting:
            if r.proc.is_alive():
                r.proc.kill()

    @staticmethod
    def join_all(replicas: list[Replica]) -> None:
        """Wait for every worker to exit after Shutdown (killed after STOP_JOIN_S)."""
        deadline = time.monotonic() + STOP_JOIN_S
        for r in replicas:
            if r.proc is None:
                continue
            r.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if r.proc.is_alive():
                r.proc.kill()
                r.proc.join(timeout=5)
            r.close_conn()
