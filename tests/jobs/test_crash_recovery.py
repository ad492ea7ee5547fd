"""kill -9 of a real server with jobs queued, running and webhooks pending; then a restart."""

from __future__ import annotations

import os
import signal
import time

import httpx

from omnistage.tests.jobs.conftest import image_job, jobs_env, sse_events, start_jobs_server, wait_for, wait_status
from omnistage.tests.serving.conftest import alive, descendants

# long enough that deliveries answered 500 are still pending when the server dies
SLOW_SCHEDULE = "0,0.3,0.6,1,2,3,5,8,13,21,34,55"


def kill_9(server) -> None:
    """SIGKILL the server and every process it started (their pids, taken before the kill)."""
    family = descendants(server.proc.pid)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    for pid in family:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: not any(alive(p) for p in family), timeout=20, what="killed workers gone")


def test_kill_9_loses_no_job_duplicates_none_and_redelivers_webhooks(tmp_path, receiver):
    env = jobs_env(tmp_path / "jobs", OMNISTAGE_JOBS_MAX_RUNNING="1", OMNISTAGE_WEBHOOK_SCHEDULE=SLOW_SCHEDULE)
    receiver.scripts["/hook"] = [(500, {})]
    hook = {"url": receiver.url("/hook"), "events": ["started", "completed"]}
    specs = [image_job(steps=2, seed=1), image_job(steps=300, seed=2), image_job(steps=3, seed=3), image_job(steps=3)]
    keys = [f"crash-{i}" for i in range(len(specs))]

    first = start_jobs_server(["tiny-image"], tmp_path / "first.log", env)
    try:
        first.wait_ready(timeout=300)
        with httpx.Client(base_url=first.url, timeout=60) as client:
            ids = [
                client.post("/v1/jobs", json={**spec, "webhook": hook}, headers={"Idempotency-Key": key}).json()["id"]
                for spec, key in zip(specs, keys, strict=True)
            ]
            wait_status(client, ids[0], ("completed",))
            wait_for(lambda: client.get(f"/v1/jobs/{ids[1]}").json()["progress"]["done"] >= 3, what="job 1 running")
            wait_for(
                lambda: any(r.body["type"] == "job.completed" for r in receiver.at("/hook")), what="a refused delivery"
            )
            assert [client.get(f"/v1/jobs/{i}").json()["status"] for i in ids[1:]] == [
                "in_progress",
                "queued",
                "queued",
            ]
    finally:
        kill_9(first)

    n_before = len(receiver.received)
    before = {r.msg_id: r.body for r in receiver.received}
    receiver.scripts["/hook"] = [(200, {})]
    second = start_jobs_server(["tiny-image"], tmp_path / "second.log", env)
    try:
        second.wait_ready(timeout=300)
        with httpx.Client(base_url=second.url, timeout=60) as client:
            again = [
                client.post("/v1/jobs", json={**spec, "webhook": hook}, headers={"Idempotency-Key": key})
                for spec, key in zip(specs, keys, strict=True)
            ]
            assert [r.json()["id"] for r in again] == ids
            assert all(r.headers.get("idempotent-replayed") == "true" for r in again)
            jobs = [wait_status(client, i, ("completed", "failed")) for i in ids]
            assert [j["status"] for j in jobs] == ["completed"] * 4
            assert [j["attempts"] for j in jobs] == [1, 2, 1, 1]  # the interrupted job ran again
            listed = client.get("/v1/jobs", params={"limit": 100}).json()["data"]
            assert sorted(j["id"] for j in listed) == sorted(ids)

            def delivered():
                ok = {r.msg_id for r in receiver.received[n_before:]}
                completed = {r.body["data"]["id"] for r in receiver.at("/hook") if r.body["type"] == "job.completed"}
                return set(before) <= ok and completed == set(ids)

            wait_for(delivered, timeout=30, what="every webhook event delivered after the restart")
        # each message refused before the crash came again with the same webhook-id and body
        after = receiver.received[n_before:]
        for msg_id, body in before.items():
            assert any(r.msg_id == msg_id and r.body == body for r in after)
        completed_ids = {}
        for r in receiver.at("/hook"):
            if r.body["type"] == "job.completed":
                completed_ids.setdefault(r.body["data"]["id"], set()).add(r.msg_id)
        assert all(len(v) == 1 for v in completed_ids.values()), completed_ids  # one message per job
        assert not receiver.rejected
    finally:
        second.stop()


def test_interrupted_jobs_fail_when_configured(tmp_path):
    env = jobs_env(tmp_path / "jobs", OMNISTAGE_JOBS_ON_INTERRUPT="fail")
    first = start_jobs_server(["tiny-image"], tmp_path / "first.log", env)
    try:
        first.wait_ready(timeout=300)
        with httpx.Client(base_url=first.url, timeout=60) as client:
            job = client.post("/v1/jobs", json=image_job(steps=300)).json()
            wait_for(lambda: client.get(f"/v1/jobs/{job['id']}").json()["progress"]["done"] >= 2, what="running")
    finally:
        kill_9(first)
    second = start_jobs_server(["tiny-image"], tmp_path / "second.log", env)
    try:
        second.wait_ready(timeout=300)
        with httpx.Client(base_url=second.url, timeout=60) as client:
            failed = client.get(f"/v1/jobs/{job['id']}").json()
            assert failed["status"] == "failed" and failed["error"]["code"] == "interrupted"
            time.sleep(0.5)
            assert client.get(f"/v1/jobs/{job['id']}").json()["attempts"] == 1
    finally:
        second.stop()


def test_sigterm_requeues_a_running_job_instead_of_canceling_it(tmp_path):
    env = jobs_env(tmp_path / "jobs")
    first = start_jobs_server(["tiny-image", "--drain-timeout", "1"], tmp_path / "first.log", env)
    try:
        first.wait_ready(timeout=300)
        with httpx.Client(base_url=first.url, timeout=60) as client:
            job = client.post("/v1/jobs", json=image_job(steps=150)).json()
            wait_for(lambda: client.get(f"/v1/jobs/{job['id']}").json()["progress"]["done"] >= 2, what="running")
    finally:
        first.stop()  # SIGTERM: a graceful stop
    assert first.proc.returncode == 0
    second = start_jobs_server(["tiny-image"], tmp_path / "second.log", env)
    try:
        second.wait_ready(timeout=300)
        with httpx.Client(base_url=second.url, timeout=60) as client:
            done = wait_status(client, job["id"], ("completed", "failed", "canceled"))
            assert done["status"] == "completed" and done["attempts"] == 2
            types = [e[1] for e in sse_events(client.get(f"/v1/jobs/{job['id']}/events").text)]
            assert "canceled" not in types and types.count("started") == 2
    finally:
        second.stop()
