"""A job whose denoiser worker is SIGKILLed under it (the runtime's recovery restarts the
worker) runs again after a backoff, the attempt count on the job and in its events; once it has
run `max_attempts` times (2 on the test server) it fails with the worker_died error."""

from __future__ import annotations

import os
import signal
import time

import httpx

from omnistage.tests.jobs.conftest import image_job, sse_events, wait_for, wait_status
from omnistage.tests.serving.conftest import cmdline, descendants

STEPS = 120  # long enough to be killed mid-denoise, short enough to finish afterwards


def denoiser_pid(server) -> int | None:
    for pid in descendants(server.proc.pid):
        if cmdline(pid).strip() == "omnistage: tiny-image/denoiser#0":
            return pid
    return None


def kill_while_denoising(client: httpx.Client, server, job_id: str, attempt: int) -> None:
    """SIGKILL the denoiser once the job's `attempt` has made progress; wait for its restart."""

    def denoising():
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] in ("queued", "in_progress"), job
        return job["status"] == "in_progress" and job["attempts"] == attempt and job["progress"]["done"] >= 1

    wait_for(denoising, timeout=120, what=f"attempt {attempt} denoising")
    pid = denoiser_pid(server)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: denoiser_pid(server) not in (None, pid), timeout=120, what="the denoiser's restart")


def events(client: httpx.Client, job_id: str) -> list[tuple[str, dict]]:
    return [(e, d) for _, e, d in sse_events(client.get(f"/v1/jobs/{job_id}/events").text)]


def test_a_job_whose_worker_died_runs_again_and_completes(jobs_server):
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        job_id = client.post("/v1/jobs", json=image_job(steps=STEPS, seed=7)).json()["id"]
        kill_while_denoising(client, jobs_server, job_id, attempt=1)
        job = wait_status(client, job_id, ("completed", "failed"), timeout=300)
        assert job["status"] == "completed", job
        assert job["attempts"] == 2 and job["error"] is None
        log = events(client, job_id)
    kinds = [e for e, _ in log]
    assert kinds[0] == "queued" and kinds[-1] == "completed"
    started = [d["attempt"] for e, d in log if e == "started"]
    assert started == [1, 2], kinds
    (retry,) = [d for e, d in log if e == "retry"]
    assert retry["attempt"] == 1 and retry["next_attempt"] == 2 and retry["in_s"] > 0
    assert retry["error"]["code"] == "worker_died" and "denoiser" in retry["error"]["message"]
    assert kinds.index("retry") < len(kinds) - 1 - kinds[::-1].index("started")  # retry, then attempt 2


def test_a_job_whose_worker_dies_on_every_attempt_fails_with_worker_died(jobs_server):
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        job_id = client.post("/v1/jobs", json=image_job(steps=1000, seed=8)).json()["id"]
        t0 = time.monotonic()
        kill_while_denoising(client, jobs_server, job_id, attempt=1)
        kill_while_denoising(client, jobs_server, job_id, attempt=2)
        job = wait_status(client, job_id, ("completed", "failed"), timeout=120)
        assert time.monotonic() - t0 < 120
        log = events(client, job_id)
    assert job["status"] == "failed" and job["attempts"] == 2, job
    assert job["error"]["code"] == "worker_died", job["error"]
    assert "ran 2 times" in job["error"]["message"] and "denoiser" in job["error"]["message"]
    assert [e for e, _ in log if e in ("started", "retry", "failed")] == ["started", "retry", "started", "failed"]
