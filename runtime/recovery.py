"""What follows a worker's death: the steps the hub takes, under its lock, when a replica's
process is gone (its pipe closed or its sentinel fired).

1. read what the worker sent before dying (a request it just finished still counts);
2. fail exactly the requests routed to it and not finished there (WorkerDiedError), after
   releasing the shared-memory slots it held for them in their producers' pools;
3. when it was its stage's only replica, set the stage's edge permits back to what the hub
   holds (a kill between a permit's take and its report would otherwise leak one);
4. schedule its own segment files for unlinking once the requests in flight now have ended;
5. restart it (a new generation), or record that its first start failed, or give up after
   MAX_RESTART_FAILURES deaths in a row before Ready and fail what waits for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from omnistage.errors import WorkerDiedError
from omnistage.runtime.ledger import DeadSegments, EdgePermits, SlotBook
from omnistage.runtime.messages import Deliver, ForgetSegments, ReleaseSlots, recv_msg
from omnistage.runtime.replicas import AfterDeath, Replica, exit_description
from omnistage.runtime.routing import RequestRecord, Router
from omnistage.runtime.shm import SegmentPool, SegmentReader, segment_prefix, worker_pool_prefix

log = logging.getLogger("omnistage.runtime")


class Recovery:
    def __init__(
        self,
        shm_prefix: str,
        router: Router,
        permits: EdgePermits,
        slots: SlotBook,
        pool: SegmentPool,
        reader: SegmentReader,
        cond: threading.Condition,
        spawn: Callable[[Replica], None],
        on_message: Callable[[Replica, object], None],
    ):
        self.shm_prefix = shm_prefix
        self.router = router
        self.replicas = router.replicas
        self.all_replicas = [r for reps in self.replicas.values() for r in reps]
        self.permits = permits
        self.slots = slots
        self.pool = pool  # the parent's own pool (the caller's inputs)
        self.reader = reader
        self.cond = cond
        self.spawn = spawn
        self.on_message = on_message
        self.dead_segments = DeadSegments()

    def on_death(self, r: Replica, stopping: bool) -> None:
        """Fail what the dead replica held, release what it held for others, then restart it
        (unless the pipeline is stopping, its first start failed, or restarts gave up)."""
        self._read_last_messages(r)  # what it sent before dying still counts
        how = r.health.killed_for or exit_description(r.proc)
        reported = r.start_failed  # it said why it could not start (logged then): its exit adds nothing
        was_ready = r.mark_down()
        r.last_stats = {}  # the dead process's figures no longer describe anything
        r.close_conn()
        self._fail_held_requests(r, how)
        if len(self.replicas[r.stage]) == 1:
            self._reconcile_permits(r.stage)
        # its own segments may still be on their way to readers: unlink once every request
        # in flight now has ended
        pool = worker_pool_prefix(self.shm_prefix, r.stage, r.index, r.generation)
        self.dead_segments.add(segment_prefix(pool, r.proc.pid), self.router.requests)
        if stopping:
            return
        if not reported:
            log.warning("omnistage: %s (pid %s) died (%s)", r.name, r.pid, how)
        after = r.after_death(how, was_ready)
        if after is AfterDeath.START_FAILED:
            self.cond.notify_all()
        elif after is AfterDeath.GIVE_UP:
            self._fail_pending(r)
        else:
            self._restart(r)

    def _fail_held_requests(self, r: Replica, how: str) -> None:
        """Fail exactly the requests routed to the dead replica and not finished there."""
        held = [self.router.requests[rid] for rid in list(r.requests) if rid in self.router.requests]
        if r.health.recycled:  # a planned restart: requests still waiting for it wait on
            held = [req for req in held if req.rid in r.health.keep]
            r.requests.difference_update(r.health.keep)
        else:
            r.requests.clear()
        self._release_slots_of_dead_reader(r, held)
        for req in held:
            self.router.finish(req, WorkerDiedError.replica_died(r.stage, r.index, how), "worker_died")

    def _reconcile_permits(self, stage: str) -> None:
        """The stage's only replica died: nobody but the hub touches its permits now."""
        held: dict[int, int] = {}
        for req in self.router.requests.values():
            for idx in req.hub_permits:
                held[idx] = held.get(idx, 0) + 1
        self.permits.reconcile(stage, held)

    def _read_last_messages(self, r: Replica) -> None:
        try:
            while r.conn is not None and r.conn.poll():
                self.on_message(r, recv_msg(r.conn))
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001
            log.exception("omnistage: reading the last messages of %s failed", r.name)

    def _release_slots_of_dead_reader(self, r: Replica, held: list[RequestRecord]) -> None:
        """The dead replica's tensors will never be freed, so the producers of the slots it held
        would never reuse those segments: release them on its behalf."""
        by_producer = self.slots.release_for_dead_reader(r.stage, [req.rid for req in held], self.pool)
        for producer, slots in by_producer.items():
            self.router.send(producer, ReleaseSlots(slots))

    def _fail_pending(self, r: Replica) -> None:
        """Restarts gave up: fail the requests whose deliveries wait for this replica."""
        for msg in r.pending:
            if isinstance(msg, Deliver) and msg.request_id in self.router.requests:
                self.router.finish(
                    self.router.requests[msg.request_id],
                    WorkerDiedError.replica_gone(r.stage, r.index, r.error),
                    "worker_died",
                )
        r.pending.clear()

    def _restart(self, r: Replica) -> None:
        r.begin_restart()
        try:
            self.spawn(r)
        except Exception as exc:  # noqa: BLE001 - e.g. the fork server is gone
            log.exception("omnistage: restarting %s failed", r.name)
            r.give_up(f"restart failed: {type(exc).__name__}: {exc}")
        self.cond.notify_all()

    def reap_dead_segments(self) -> None:
        for prefix in self.dead_segments.reap(self.router.requests.keys()):
            self.reader.forget(prefix + "-")
            for x in self.all_replicas:
                if x.ready:
                    self.router.send(x, ForgetSegments(prefix + "-"))
