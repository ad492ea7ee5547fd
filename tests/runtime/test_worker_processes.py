"""What a worker process looks like from outside: its name in `ps`, and what it leaves in
/dev/shm when it is killed and restarted."""

import os
import signal
import time

import pytest

from omnistage.tests.runtime.conftest import semaphore_files, semaphore_inodes


def test_ps_shows_each_worker_as_pipeline_stage_and_replica(diamond):
    pids = diamond.worker_pids()
    assert sum(len(reps) for reps in pids.values()) >= 4
    for stage, reps in pids.items():
        for index, pid in enumerate(reps):
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0].decode()
            assert cmdline == f"omnistage: tiny-diamond/{stage}#{index}"
            assert open(f"/proc/{pid}/comm").read().strip() == "omnistage: tiny"  # the kernel keeps 15 chars
            # the title does not overwrite the environment (tools and tests read it)
            assert any(v.startswith(b"PATH=") for v in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"))


@pytest.fixture(scope="module")
def llm():
    from omnistage.runtime.pipeline import Pipeline

    p = Pipeline.from_yaml("tiny-llm", ready_timeout=300)
    yield p
    p.close(drain_timeout=5)


def test_killed_workers_leave_no_semaphore_behind(llm):
    # Loading the LM's weights shows a (disabled) tqdm bar, which creates a multiprocessing
    # lock. Only the worker that made a named semaphore file unlinks it, on a clean exit: a
    # SIGKILLed worker's file stayed in /dev/shm until the whole program exited.
    seen: set[int] = set()
    for _ in range(3):
        pid = llm.worker_pids()["llm"][0]
        inodes = semaphore_inodes(pid)
        assert inodes, "the ar_lm worker holds no semaphore: this test would prove nothing"
        seen |= inodes
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while llm.worker_pids()["llm"][0] == pid and time.monotonic() < deadline:
            time.sleep(0.02)  # until the hub has seen the death and started a new process
        assert llm.worker_pids()["llm"][0] != pid
        llm.wait_ready(120)
    assert semaphore_files(seen) == []
    out = llm.run({"prompt": "hi"}, params={"llm": {"max_tokens": 2, "temperature": 0.0}}, timeout=60)
    assert len(out["tokens"]) == 2
