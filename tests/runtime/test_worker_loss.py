"""Closing during start-up, and what a dead worker held (edge permits, shared-memory slots)."""

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from omnistage.errors import WorkerDiedError
from omnistage.tests.runtime.conftest import pid_exists, slow_build_yaml

# `a` holds each request for params.a.delay seconds, then `b` for params.b.delay; at most one
# request is between a and b-finished (max_inflight: 1), so one leaked permit starves the edge.
LOSS_YAML = """
name: worker-loss
inputs: {x: tensor}
outputs: {y: tensor}
stages:
  a:
    kind: torch_module
    params: {factory: "omnistage.runtime.testmodules:Sleeper", inputs: {x: tensor}, outputs: {y: tensor}, pass_params: true}
    batching: {policy: none}
  b:
    kind: torch_module
    params: {factory: "omnistage.runtime.testmodules:Sleeper", inputs: {x: tensor}, outputs: {y: tensor}, pass_params: true}
    batching: {policy: none}
edges:
  - {from: inputs.x, to: a.x}
  - {from: a.y, to: b.x, max_inflight: 1}
  - {from: b.y, to: outputs.y}
"""


def _segments(prefix):
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefix))


def test_close_while_replicas_are_still_starting_is_quick():
    from omnistage.graph.loader import load_pipeline_text
    from omnistage.runtime.pipeline import Pipeline

    t_start = time.monotonic()
    p = Pipeline.from_spec(load_pipeline_text(slow_build_yaml(120, replicas=2), "slow-build.yaml"), wait_ready=False)
    start_s = time.monotonic() - t_start  # spawning the two workers: this machine's pace right now
    pids = [pid for reps in p.worker_pids().values() for pid in reps]
    assert len(pids) == 2 and all(pid is not None and pid_exists(pid) for pid in pids)
    assert not p.ready and p.stage_ready() == {"loading": False}
    t0 = time.monotonic()
    p.close(drain_timeout=30)
    took = time.monotonic() - t0
    # not the 120 s build nor fixed join timeouts: about what spawning took (5 s on a quiet
    # machine; on a loaded one spawning slows down as much as closing does)
    assert took < max(5.0, 2 * start_s), f"close() during start-up took {took:.1f}s (spawning took {start_s:.1f}s)"
    assert not [pid for pid in pids if pid_exists(pid)]
    assert not [c for c in multiprocessing.active_children() if c.name.startswith("omnistage:slow-build:")]
    assert not _segments(p.shm_prefix)
    assert p.stage_ready() == {"loading": False}


@pytest.fixture(scope="module")
def loss():
    from omnistage.graph.loader import load_pipeline_text
    from omnistage.runtime.pipeline import Pipeline

    p = Pipeline.from_spec(load_pipeline_text(LOSS_YAML, "worker-loss.yaml"), ready_timeout=120)
    yield p
    p.close(drain_timeout=5)


def _kill_while_holding(p, stage, x):
    """Send a request that `stage` holds for 30 s, SIGKILL that worker, expect WorkerDiedError."""
    result: dict = {}
    params = {"a": {"delay": 30.0 if stage == "a" else 0.0}, "b": {"delay": 30.0 if stage == "b" else 0.0}}

    def call():
        try:
            result["out"] = p.run({"x": x}, params=params, timeout=60)
        except Exception as exc:  # noqa: BLE001
            result["error"] = exc

    t = threading.Thread(target=call)
    t.start()
    # routed there (the hub's own table), then inside its engine (the worker's figures; on a
    # loaded machine those were seen to lag, so after 3 s the routing alone will do: the
    # request sleeps 30 s there)
    deadline = time.monotonic() + 20
    while p.replica_stats()[stage][0]["held_requests"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.replica_stats()[stage][0]["held_requests"] == 1
    settle = time.monotonic() + 3
    while p.replica_stats()[stage][0].get("inflight", 0) == 0 and time.monotonic() < settle:
        time.sleep(0.02)
    os.kill(p.worker_pids()[stage][0], signal.SIGKILL)
    t.join(30)
    err = result.get("error")
    assert isinstance(err, WorkerDiedError), result
    # what a client reads: stage, replica, how it ended, that a retry can help; nothing more
    msg = str(err)
    assert f"stage {stage!r}" in msg and "replica 0" in msg and "SIGKILL" in msg and "retryable" in msg, msg
    assert "not retryable" not in msg and "\n" not in msg and "pid" not in msg, msg
    p.wait_ready(60)


def test_dead_workers_leak_no_permit_and_no_shared_memory(loss):
    x = torch.randn(100_000)  # 400 KB: travels through /dev/shm on every edge

    def round_trip():
        # a leaked permit on the max_inflight: 1 edge would hold this request until its deadline
        return torch.equal(loss.run({"x": x}, timeout=20)["y"], x)

    assert round_trip()
    # `a` dies holding the edge's only permit and a slot of the caller's input segment; then
    # `b` dies (three times, all against the same `a` process) holding a slot of a's output
    for stage in ("a", "a", "a", "b", "b", "b"):
        _kill_while_holding(loss, stage, x)
        assert round_trip(), f"requests stopped flowing after {stage} died"
    for _ in range(3):
        assert round_trip()
    pids = {s: reps[0] for s, reps in loss.worker_pids().items()}

    def files_by_owner():
        owners: dict[str, list[str]] = {}
        for name in _segments(loss.shm_prefix):
            owner = (
                "parent" if "-parent-" in name else next((s for s, pid in pids.items() if f"-{pid}-" in name), "dead")
            )
            owners.setdefault(owner, []).append(name)
        return owners

    deadline = time.monotonic() + 30
    while "dead" in files_by_owner() and time.monotonic() < deadline:
        time.sleep(0.05)
    owners = files_by_owner()
    assert "dead" not in owners, owners  # dead workers' files are unlinked
    # a producer needs at most two segments here (one may still be viewed by the consumer of
    # the previous request); slots a dead reader never released would add one per death
    assert all(len(names) <= 2 for names in owners.values()), owners


def test_force_release_never_touches_a_later_use_of_the_segment():
    from omnistage.runtime.shm import SegmentPool, SegmentReader, cleanup_prefix

    prefix = f"omnistage-test-{os.getpid()}-force"
    pool, reader = SegmentPool(prefix), SegmentReader()
    try:
        first = pool.put(torch.arange(20_000, dtype=torch.float32), nreaders=2)
        reader.release(first, 0)
        assert pool.force_release(first.segment, first.use, 1)  # a dead reader's slot
        second = pool.put(torch.ones(20_000), nreaders=2)
        assert second.segment == first.segment and second.use == first.use + 1  # reused once free
        # a late release on behalf of the first use must leave the second use's readers alone
        assert not pool.force_release(first.segment, first.use, 0)
        view = reader.tensor(second, 0)
        third = pool.put(torch.zeros(20_000), nreaders=1)
        assert third.segment != second.segment  # slot 1 of the second use is still held
        assert torch.equal(view, torch.ones(20_000))
    finally:
        reader.close()
        pool.close(unlink=True)
        cleanup_prefix(prefix)
