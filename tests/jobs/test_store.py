"""The job store's contract, run against SQLite and a real PostgreSQL server (tests/jobs/postgres.py).

Two store instances on one database stand for two servers: their claims of queued jobs and of
outbox messages never overlap, and one idempotency key makes one job."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from omnistage.serving.jobs.model import Job, JobStatus
from omnistage.serving.jobs.schema import MIGRATIONS
from omnistage.serving.jobs.store import SQLiteJobStore


@pytest.fixture(params=["sqlite", "postgresql"])
def open_store(request, tmp_path):
    """A function that opens another store on the same fresh database (another server)."""
    if request.param == "sqlite":
        path = tmp_path / "jobs.sqlite3"

        def opener():
            return SQLiteJobStore(path)
    else:
        from omnistage.serving.jobs.store_pg import PostgresJobStore

        url = request.getfixturevalue("postgres").create_database(f"t_{uuid.uuid4().hex[:12]}")

        def opener():
            return PostgresJobStore(url)

    opened = []

    def open_one():
        opened.append(opener())
        return opened[-1]

    yield open_one
    for store in opened:
        store.close()


def job(n: int, model: str = "m", **fields) -> Job:
    return Job(id=f"job_{n:04d}", model=model, inputs={"prompt": str(n)}, params={}, created_at=1000.0 + n, **fields)


def test_schema_is_migrated_once_to_the_current_version(open_store):
    first = open_store()
    assert first.schema_version == len(MIGRATIONS) == 4
    first.create_job(job(1))
    second = open_store()  # opening again applies nothing twice and keeps the rows
    assert second.schema_version == len(MIGRATIONS) and second.get_job("job_0001").inputs == {"prompt": "1"}


def test_submissions_positions_idempotency_and_owner_limits(open_store):
    store = open_store()
    results = store.create_jobs(
        [job(1), job(2, idempotency_key="k"), job(3, priority=5), job(4, idempotency_key="k"), job(5, owner="a")],
        max_queued_per_owner=None,
    )
    assert [r.created for r in results] == [True, True, True, False, True]
    assert results[3].job.id == "job_0002"  # the key's first job, not a duplicate
    positions = {r.job.id: store.queue_position(store.get_job(r.job.id)) for r in results if r.created}
    assert positions == {"job_0003": 0, "job_0001": 1, "job_0002": 2, "job_0005": 3}
    assert [r.queue_position for r in results if r.created] == [0, 1, 0, 3]  # as known when each was stored
    limited = store.create_jobs([job(6, owner="a"), job(7, owner="a"), job(8, owner="b")], max_queued_per_owner=2)
    assert [(r.created, r.refused) for r in limited] == [(True, None), (False, "queue_full"), (True, None)]
    assert store.get_job("job_0007") is None
    assert [j.id for j in store.list_jobs(10, owner="a")] == ["job_0006", "job_0005"]
    assert [j.id for j in store.list_jobs(2, after="job_0006")] == ["job_0005", "job_0003"]
    claimed = store.claim_queued("m", 2, runner="r1", lease_until=50.0)
    assert [j.id for j in claimed] == ["job_0003", "job_0001"]  # priority first, then oldest
    assert all(j.status is JobStatus.IN_PROGRESS and j.attempts == 1 for j in claimed)
    assert store.queue_position(store.get_job("job_0002")) == 0


def test_event_update_and_webhook_message_commit_together(open_store):
    store = open_store()
    store.create_job(job(1))
    hook = {"url": "http://hooks.example/a", "secret": None, "payload": '{"x": 1}'}
    started = store.record_event("job_0001", "started", {"attempt": 1}, webhook=hook, job_update={"progress_total": 4})
    done = store.record_event("job_0001", "completed", {}, webhook=hook, job_update={"status": JobStatus.COMPLETED})
    assert done.seq > started.seq
    assert [e.type for e in store.events_after("job_0001", 0)] == ["queued", "started", "completed"]
    assert [e.type for e in store.events_after("job_0001", started.seq)] == ["completed"]
    record = store.get_job("job_0001")
    assert record.status is JobStatus.COMPLETED and record.progress_total == 4
    now = time.time()
    first = store.claim_deliveries(now, 10, lease_s=60)
    assert [d.event_type for d in first] == ["started", "completed"]
    assert store.claim_deliveries(now, 10, lease_s=60) == []  # leased to the first claimer
    store.record_attempt(first[0], status_code=500, latency_ms=3.0, error=None, outcome="pending",
                         next_attempt_at=now + 30)  # fmt: skip
    store.record_attempt(first[1], status_code=200, latency_ms=2.0, error=None, outcome="delivered")
    assert store.claim_deliveries(now + 1, 10, lease_s=60) == []  # retry not due yet
    (retry,) = store.claim_deliveries(now + 31, 10, lease_s=60)
    assert retry.id == first[0].id and retry.attempts == 1  # the same webhook-id on every attempt
    assert [a["status_code"] for a in store.attempts_for_job("job_0001")] == [500, 200]
    store.release_deliveries([retry.id])
    assert [d.id for d in store.claim_deliveries(now + 31, 10, lease_s=60)] == [retry.id]
    store.disable_endpoint(hook["url"], "410 Gone")
    assert store.endpoint_disabled(hook["url"])
    assert {d.status for d in store.deliveries_for_job("job_0001")} == {"disabled", "delivered"}
    store.record_event("job_0001", "progress", {}, webhook=hook)
    assert len(store.deliveries_for_job("job_0001")) == 2  # a disabled endpoint gets nothing new


def test_leases_decide_which_running_jobs_are_interrupted(open_store):
    store = open_store()
    store.create_jobs([job(1), job(2)])
    store.claim_queued("m", 1, runner="alive", lease_until=100.0)
    store.claim_queued("m", 1, runner="dead", lease_until=10.0)
    assert [j.id for j in store.interrupted_jobs(50.0)] == ["job_0002"]  # only the lapsed lease
    assert len(store.interrupted_jobs()) == 2  # a lone server's restart: every running job
    store.update_job("job_0001", cancel_requested=True)
    assert store.renew_leases("alive", 200.0) == ["job_0001"]
    assert store.interrupted_jobs(150.0) == [store.get_job("job_0002")]
    store.delete_job("job_0002")
    assert store.get_job("job_0002") is None and store.events_after("job_0002", 0) == []


def test_two_servers_never_claim_the_same_job_or_message(open_store):
    a, b = open_store(), open_store()
    a.create_jobs([job(n) for n in range(40)])
    for n in range(40):
        a.record_event(f"job_{n:04d}", "completed", {}, webhook={"url": "http://h/x", "secret": None, "payload": "{}"})
    claims: dict[str, list[str]] = {"a": [], "b": []}
    barrier = threading.Barrier(2)

    def claimer(name, store):
        barrier.wait()
        while True:
            time.sleep(0.002)  # let the other server in between claims
            jobs = store.claim_queued("m", 3, runner=name, lease_until=time.time() + 60)
            messages = store.claim_deliveries(time.time(), 3, lease_s=60)
            if not jobs and not messages:
                return
            claims[name] += [j.id for j in jobs] + [d.id for d in messages]

    threads = [threading.Thread(target=claimer, args=item) for item in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not set(claims["a"]) & set(claims["b"])
    assert len(claims["a"]) + len(claims["b"]) == 80 and claims["a"] and claims["b"]


def test_one_idempotency_key_one_job_across_servers(open_store):
    a, b = open_store(), open_store()
    results = []
    barrier = threading.Barrier(2)

    def submit(store, n):
        barrier.wait()
        results.append(store.create_jobs([job(n, idempotency_key="same")])[0])

    threads = [threading.Thread(target=submit, args=(s, n)) for s, n in ((a, 1), (b, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(r.created for r in results) == [False, True]
    assert results[0].job.id == results[1].job.id
    assert len(a.list_jobs(10)) == 1
