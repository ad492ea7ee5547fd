"""Two `omnistage serve` processes (two ingress replicas) sharing one real PostgreSQL job store
and one jobs directory: each webhook event is delivered exactly once per attempt, and a job
submitted through one server is read and canceled through the other."""

from __future__ import annotations

import uuid
from collections import Counter

import httpx
import psycopg
import pytest

from omnistage.tests.jobs.conftest import image_job, jobs_env, start_jobs_server, wait_for, wait_status


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory, postgres):
    base = tmp_path_factory.mktemp("jobs-shared")
    url = postgres.create_database(f"shared_{uuid.uuid4().hex[:12]}")
    env = jobs_env(base / "jobs", OMNISTAGE_JOBS_MAX_RUNNING="2")
    servers = []
    try:  # one is given the database by the serve option, the other by the environment
        servers.append(start_jobs_server(["tiny-image", "--jobs-db", url], base / "server-a.log", env))
        servers.append(start_jobs_server(["tiny-image"], base / "server-b.log", {**env, "OMNISTAGE_JOBS_DB": url}))
        for server in servers:
            server.wait_ready(timeout=300)
        yield servers, url
    finally:
        for server in servers:
            server.stop()


def runners(url: str, job_ids: list[str]) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT id, runner FROM jobs WHERE id = ANY(%s)", (job_ids,)).fetchall()
    return dict(rows)


def test_each_webhook_event_is_delivered_once_per_attempt(two_servers, receiver):
    (a, b), url = two_servers
    receiver.scripts["/flaky"] = [(500, {}), (200, {})] * 100  # every other request fails: retries happen
    ids = []
    with httpx.Client(timeout=60) as client:
        for i in range(8):
            server = (a, b)[i % 2]
            path = "/flaky" if i == 0 else "/ok"
            hook = {"url": receiver.url(path), "events": ["started", "completed"]}
            created = client.post(f"{server.url}/v1/jobs", json=image_job(steps=2, seed=i, webhook=hook))
            assert created.status_code == 202, created.text
            ids.append(created.json()["id"])
        jobs = [wait_status(httpx.Client(base_url=a.url, timeout=60), job_id, ("completed",)) for job_id in ids]
        wait_for(lambda: len({r.msg_id for r in receiver.received if r.path == "/ok"}) == 14, 60, "14 /ok events")
        wait_for(lambda: len({r.msg_id for r in receiver.at("/flaky")}) == 2, 60, "the flaky job's 2 events")
        wait_for(lambda: len(receiver.at("/flaky")) == 4, 60, "each flaky event twice (500, then 200)")
        assert not receiver.rejected
        # every message arrived exactly as many times as attempts were recorded for it, the same id each time
        arrivals = Counter(r.msg_id for r in receiver.received)
        attempts = Counter()
        for job_id in ids:
            for attempt in client.get(f"{b.url}/v1/jobs/{job_id}").json()["webhook"]["attempts"]:
                attempts[attempt["delivery_id"]] += 1
        assert arrivals == attempts and len(arrivals) == 16
        assert all(arrivals[r.msg_id] == 1 for r in receiver.received if r.path == "/ok")
        assert {j["status"] for j in jobs} == {"completed"}
    assert len(set(runners(url, ids).values())) == 2  # both servers ran jobs


def test_a_job_is_read_and_canceled_through_the_other_server(two_servers):
    (a, b), url = two_servers
    with httpx.Client(timeout=60) as client:
        done = client.post(f"{a.url}/v1/jobs", json=image_job(steps=2, seed=5)).json()
        finished = wait_status(httpx.Client(base_url=b.url, timeout=60), done["id"], ("completed",))
        (file,) = finished["outputs"]["image"]["files"]
        from_a, from_b = client.get(a.url + file["url"]), client.get(b.url + file["url"])
        assert from_a.status_code == from_b.status_code == 200 and from_a.content == from_b.content
        listed = client.get(f"{b.url}/v1/jobs", params={"limit": 100}).json()["data"]
        assert done["id"] in [j["id"] for j in listed]

        long = client.post(f"{a.url}/v1/jobs", json=image_job(steps=400, seed=6)).json()
        running = wait_status(httpx.Client(base_url=a.url, timeout=60), long["id"], ("in_progress",))
        assert running["status"] == "in_progress"
        runner_pid = int(runners(url, [long["id"]])[long["id"]].split(":")[1])
        other = b if runner_pid == a.proc.pid else a
        assert runner_pid in (a.proc.pid, b.proc.pid) and other.proc.pid != runner_pid
        answer = client.delete(f"{other.url}/v1/jobs/{long['id']}")
        assert answer.status_code == 200, answer.text
        canceled = wait_status(httpx.Client(base_url=other.url, timeout=60), long["id"], ("canceled", "completed"), 30)
        assert canceled["status"] == "canceled" and canceled["progress"]["done"] < 400
        again = client.delete(f"{other.url}/v1/jobs/{long['id']}")
        assert again.status_code == 409 and again.json()["error"]["code"] == "job_finished"


def test_a_starting_server_requeues_only_jobs_whose_lease_lapsed(postgres, tmp_path):
    import asyncio
    import time

    from omnistage.serving.jobs.model import Job, JobsConfig, JobStatus
    from omnistage.serving.jobs.service import JobService
    from omnistage.serving.jobs.store_pg import PostgresJobStore
    from omnistage.serving.registry import PipelineRegistry

    url = postgres.create_database(f"start_{uuid.uuid4().hex[:12]}")
    store = PostgresJobStore(url)
    try:
        store.create_jobs([Job(id=f"job_{name}", model="m", inputs={}, params={}) for name in ("live", "dead")])
        store.claim_queued("m", 1, runner="live-server", lease_until=time.time() + 60)
        store.claim_queued("m", 1, runner="dead-server", lease_until=time.time() - 1)

        async def start_and_stop():
            service = JobService(PipelineRegistry(), JobsConfig(directory=tmp_path / "jobs", db_url=url))
            await service.start()
            await service.stop()

        asyncio.run(start_and_stop())
        assert store.get_job("job_live").status is JobStatus.IN_PROGRESS  # another server still runs it
        assert store.get_job("job_dead").status is JobStatus.QUEUED  # its server is gone: it runs again
    finally:
        store.close()
