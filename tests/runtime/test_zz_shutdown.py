"""Runs last: closing the shared pipelines leaves no worker process and no /dev/shm segment."""

import multiprocessing
import os

import torch

from omnistage.tests.runtime.conftest import pid_exists


def test_close_leaves_no_process_or_shared_memory(diamond, sleepy):
    # use shared memory in both before closing
    assert torch.equal(sleepy.run({"x": torch.ones(100_000)})["y"], torch.ones(100_000))
    diamond.run({"x": torch.randn(1100, 8)})  # > 32 KiB: input travels via /dev/shm
    pipelines = [diamond, sleepy]
    pids = [pid for p in pipelines for reps in p.worker_pids().values() for pid in reps]
    prefixes = [p.shm_prefix for p in pipelines]
    assert any(f.startswith(prefixes[0]) for f in os.listdir("/dev/shm"))
    for p in pipelines:
        p.close(drain_timeout=5)
        assert not p.ready
    assert not [pid for pid in pids if pid_exists(pid)]
    assert not [c for c in multiprocessing.active_children() if c.pid in pids]
    assert not [f for f in os.listdir("/dev/shm") if any(f.startswith(pre) for pre in prefixes)]
