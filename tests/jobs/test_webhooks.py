"""Job webhooks delivered to a real local receiver, verified with the `standardwebhooks` package."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import httpx
from standardwebhooks.webhooks import Webhook

from omnistage.serving.jobs.webhooks import webhook_headers
from omnistage.tests.jobs.conftest import OLD_SECRET, SECRET, image_job, wait_for, wait_status


def test_signer_matches_the_reference_for_every_rotated_secret():
    body = '{"type":"job.completed","data":{"id":"job_1"}}'
    headers = webhook_headers([SECRET, OLD_SECRET], "msg_1", 1_700_000_000, body)
    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in (SECRET, OLD_SECRET):
        expected = Webhook(secret).sign("msg_1", datetime.fromtimestamp(1_700_000_000, tz=UTC), body)
        assert expected in headers["webhook-signature"].split(" ")


def test_500_twice_then_200_delivers_one_id_three_times(jobs_server, receiver):
    receiver.scripts["/flaky"] = [(500, {}), (500, {}), (200, {})]
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        job = client.post("/v1/jobs", json=image_job(webhook={"url": receiver.url("/flaky")})).json()
        assert job["webhook"]["events"] == ["completed", "failed", "canceled"]
        wait_status(client, job["id"], ("completed",))
        wait_for(lambda: len(receiver.at("/flaky")) >= 3, what="three deliveries")
        got = receiver.at("/flaky")
        assert not receiver.rejected
        assert len({r.msg_id for r in got}) == 1 and len(got) == 3
        assert all(r.body["type"] == "job.completed" and r.body["data"]["id"] == job["id"] for r in got)
        assert got[0].body["data"]["status"] == "completed"
        assert got[0].body["data"]["outputs"]["image"]["files"][0]["media_type"] == "image/png"
        # the compressed schedule: retries 0.3 s and 0.6 s apart, stretched by at most 10 %
        gaps = [b.at - a.at for a, b in zip(got, got[1:], strict=False)]
        assert 0.25 <= gaps[0] <= 1.5 and 0.55 <= gaps[1] <= 2.0, gaps
        attempts = wait_for(
            lambda: (a := client.get(f"/v1/jobs/{job['id']}").json()["webhook"]["attempts"]) and len(a) == 3 and a,
            what="attempts recorded",
        )
        assert [a["status_code"] for a in attempts] == [500, 500, 200]
        assert all(a["latency_ms"] >= 0 and a["event_type"] == "completed" for a in attempts)


def test_410_disables_the_endpoint(jobs_server, receiver):
    receiver.scripts["/gone"] = [(410, {})]
    hook = {"url": receiver.url("/gone"), "events": ["started", "progress", "completed"]}
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        job = client.post("/v1/jobs", json=image_job(steps=6, webhook=hook)).json()
        wait_status(client, job["id"], ("completed",))
        wait_for(lambda: receiver.at("/gone"), what="the first delivery")
        second = client.post("/v1/jobs", json=image_job(steps=2, webhook=hook)).json()
        wait_status(client, second["id"], ("completed",))
        time.sleep(1.0)  # longer than the compressed schedule's first retries
        assert len(receiver.at("/gone")) == 1
        assert receiver.at("/gone")[0].body["type"] == "job.started"
        assert [a["status_code"] for a in client.get(f"/v1/jobs/{job['id']}").json()["webhook"]["attempts"]] == [410]
        assert client.get(f"/v1/jobs/{second['id']}").json()["webhook"]["attempts"] == []


def test_retry_after_is_honoured_and_progress_events_are_signed(jobs_server, receiver):
    receiver.scripts["/busy"] = [(429, {"Retry-After": "2"}), (200, {})]
    hook = {"url": receiver.url("/busy"), "events": ["started", "progress", "completed"]}
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        job = client.post("/v1/jobs", json=image_job(steps=3, webhook=hook)).json()
        wait_status(client, job["id"], ("completed",))
        wait_for(lambda: len(receiver.at("/busy")) == 6, what="five events and one retry delivered")
        got = receiver.at("/busy")
        first_id = got[0].msg_id
        retry = [r for r in got[1:] if r.msg_id == first_id]
        assert retry and retry[0].at - got[0].at >= 1.9
        types = sorted({(r.msg_id, r.body["type"]) for r in got}, key=lambda x: x[1])
        assert sorted(t for _, t in types) == [
            "job.completed",
            "job.progress",
            "job.progress",
            "job.progress",
            "job.started",
        ]
        assert not receiver.rejected
