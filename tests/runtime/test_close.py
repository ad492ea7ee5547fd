"""Closing a pipeline leaves no worker process, no /dev/shm segment and no semaphore file.

The pipelines here are the test's own (the shared session ones stay open for other tests),
so this runs in any order; a finalizer closes them even when an assertion fails first.
"""

import multiprocessing
import os

import pytest
import torch

from omnistage.tests.runtime.conftest import SMALL_YAML, pid_exists, semaphore_files, semaphore_inodes


@pytest.fixture
def own_pipelines():
    from omnistage.graph.loader import load_pipeline_text
    from omnistage.runtime.pipeline import Pipeline

    pipelines = []
    try:
        pipelines.append(Pipeline.from_yaml("tiny-diamond", ready_timeout=120))
        pipelines.append(Pipeline.from_spec(load_pipeline_text(SMALL_YAML, "sleepy.yaml"), ready_timeout=120))
        yield pipelines
    finally:
        for p in pipelines:
            p.close(drain_timeout=0)  # no-op for those the test closed


def test_close_leaves_no_process_or_shared_memory(own_pipelines):
    diamond, sleepy = own_pipelines
    # use shared memory in both before closing
    assert torch.equal(sleepy.run({"x": torch.ones(100_000)})["y"], torch.ones(100_000))
    diamond.run({"x": torch.randn(1100, 8)})  # > 32 KiB: input travels via /dev/shm
    pids = [pid for p in own_pipelines for reps in p.worker_pids().values() for pid in reps]
    # the max_inflight edge out of sleepy's `pre`: a semaphore file the parent made, which its
    # producer's worker maps
    permit_inodes = semaphore_inodes(sleepy.worker_pids()["pre"][0])
    assert permit_inodes and semaphore_files(permit_inodes)
    prefixes = [p.shm_prefix for p in own_pipelines]
    assert any(f.startswith(prefixes[0]) for f in os.listdir("/dev/shm"))
    for p in own_pipelines:
        p.close(drain_timeout=5)
        assert not p.ready
    assert not [pid for pid in pids if pid_exists(pid)]
    assert not [c for c in multiprocessing.active_children() if c.pid in pids]
    assert not [f for f in os.listdir("/dev/shm") if any(f.startswith(pre) for pre in prefixes)]
    assert semaphore_files(permit_inodes) == []


INTERRUPTED_RUN = """
import os, signal, threading, time
from omnistage.runtime.pipeline import Pipeline

# Ctrl+C as in a terminal: a runner started in the background (nohup ... &, some CI launchers)
# passes SIGINT down ignored, and this program would inherit that
signal.signal(signal.SIGINT, signal.default_int_handler)
with Pipeline.from_yaml("tiny-image", ready_timeout=120) as p:
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:  # 1000 denoiser steps: tens of seconds; an aborted request leaves at its next step
        p.run({"prompt": "a cube"}, {"denoiser": {"num_inference_steps": 1000, "width": 64, "height": 64}})
    except KeyboardInterrupt:
        print("in flight", p.num_requests(), flush=True)
        closing = time.monotonic()
    else:
        print("run() was not interrupted", flush=True)
        closing = time.monotonic()
print("closed in", round(time.monotonic() - closing, 1), flush=True)
"""


def test_ctrl_c_in_run_aborts_its_request_and_close_does_not_wait_for_it():
    """Ctrl+C while `run()` waits: the request leaves the pipeline at once, so leaving the
    `with` block closes without waiting out the drain timeout (30 s) for it."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_RUN], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "in flight 0", done.stdout
    assert float(lines[1].split()[-1]) < 10, done.stdout
