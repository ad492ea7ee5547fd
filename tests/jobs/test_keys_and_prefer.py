"""Jobs belong to the API key that made them; per-key queue limit; `Prefer: respond-async` on
/v1/images/generations. One `omnistage serve --api-key A --api-key B` with jobs."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
import websockets
from PIL import Image

from omnistage.tests.jobs.conftest import image_job, jobs_env, start_jobs_server, wait_status

KEY_A, KEY_B = "sk-jobs-owner-a", "sk-jobs-owner-b"
MAX_QUEUED = 2


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("jobs-keys")
    env = jobs_env(base / "jobs", OMNISTAGE_JOBS_MAX_RUNNING="1", OMNISTAGE_JOBS_MAX_QUEUED_PER_KEY=str(MAX_QUEUED))
    server = start_jobs_server(["tiny-image", "--api-key", KEY_A, "--api-key", KEY_B], base / "server.log", env)
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()


def client_for(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def test_another_keys_job_is_not_found_anywhere(keyed_server):
    with client_for(keyed_server, KEY_A) as a, client_for(keyed_server, KEY_B) as b:
        created = a.post("/v1/jobs", json=image_job(steps=2, seed=3))
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
        done = wait_status(a, job_id, ("completed", "failed"))
        assert done["status"] == "completed", done
        (file,) = done["outputs"]["image"]["files"]
        assert a.get(file["url"]).status_code == 200
        for method, path in (
            ("GET", f"/v1/jobs/{job_id}"),
            ("DELETE", f"/v1/jobs/{job_id}"),
            ("GET", f"/v1/jobs/{job_id}/events"),
            ("GET", file["url"]),
            ("GET", f"/v1/jobs/{job_id}/stream"),
        ):
            answer = b.request(method, path)
            assert answer.status_code == 404, (method, path, answer.text)
            assert answer.json()["error"]["code"] == "job_not_found"
        assert job_id in [j["id"] for j in a.get("/v1/jobs", params={"limit": 100}).json()["data"]]
        assert job_id not in [j["id"] for j in b.get("/v1/jobs", params={"limit": 100}).json()["data"]]
        assert a.get(f"/v1/jobs/{job_id}").json()["status"] == "completed"  # B's DELETE did nothing
        # an Idempotency-Key belongs to the API key that sent it: B's same key is B's own job
        same = {"Idempotency-Key": "order-17"}
        first_a = a.post("/v1/jobs", json=image_job(steps=2, seed=4), headers=same)
        first_b = b.post("/v1/jobs", json=image_job(steps=2, seed=4), headers=same)
        assert first_a.status_code == first_b.status_code == 202, first_b.text
        assert first_a.json()["id"] != first_b.json()["id"] and "idempotent-replayed" not in first_b.headers
        again_b = b.post("/v1/jobs", json=image_job(steps=2, seed=4), headers=same)
        assert again_b.json()["id"] == first_b.json()["id"] and again_b.headers["idempotent-replayed"] == "true"

    async def ws_first(path: str, key: str):
        url = keyed_server.url.replace("http", "ws") + path
        try:
            async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
                return await asyncio.wait_for(ws.recv(), 30)
        except websockets.InvalidStatus as refused:  # closed before the handshake completed
            return refused.response.status_code

    first_of_a = asyncio.run(ws_first(f"/v1/jobs/{job_id}/stream", KEY_A))
    assert isinstance(first_of_a, bytes | str), first_of_a  # the owner is streamed the job
    # the other key is refused exactly like a job that does not exist
    assert asyncio.run(ws_first(f"/v1/jobs/{job_id}/stream", KEY_B)) == 403
    assert asyncio.run(ws_first("/v1/jobs/job_nope/stream", KEY_B)) == 403


def test_a_key_with_a_full_queue_gets_429_and_others_do_not(keyed_server):
    with client_for(keyed_server, KEY_A) as a, client_for(keyed_server, KEY_B) as b:
        answers = [a.post("/v1/jobs", json=image_job(steps=40, seed=i)) for i in range(MAX_QUEUED + 2)]
        accepted = [r.json()["id"] for r in answers if r.status_code == 202]
        refused = [r for r in answers if r.status_code == 429]
        assert refused, [r.status_code for r in answers]
        assert len(accepted) <= MAX_QUEUED + 1  # at most one left the queue by starting
        err = refused[0].json()["error"]
        assert err["code"] == "job_queue_full" and "queued jobs" in err["message"]
        assert int(refused[0].headers["retry-after"]) >= 1
        other = b.post("/v1/jobs", json=image_job(steps=2))
        assert other.status_code == 202, other.text  # the limit is per key
        for job_id in accepted:
            a.delete(f"/v1/jobs/{job_id}")
        again = a.post("/v1/jobs", json=image_job(steps=2))
        assert again.status_code == 202, again.text  # canceled jobs free the key's queue
        for job_id in (other.json()["id"], again.json()["id"]):
            wait_status(a if job_id == again.json()["id"] else b, job_id, ("completed",))


def test_prefer_respond_async_makes_an_image_job_with_the_same_pixels(keyed_server):
    body = {"model": "tiny-image", "prompt": "a blue sphere", "size": "64x64", "num_inference_steps": 2, "seed": 11}
    with client_for(keyed_server, KEY_A) as a, client_for(keyed_server, KEY_B) as b:
        sync = a.post("/v1/images/generations", json=body)
        assert sync.status_code == 200, sync.text
        accepted = a.post("/v1/images/generations", json=body, headers={"Prefer": "wait=5, respond-async"})
        assert accepted.status_code == 202, accepted.text
        job = accepted.json()
        assert job["object"] == "job" and accepted.headers["location"] == f"/v1/jobs/{job['id']}"
        assert accepted.headers["preference-applied"] == "respond-async"
        done = wait_status(a, job["id"], ("completed", "failed"))
        assert done["status"] == "completed", done
        (file,) = done["outputs"]["image"]["files"]
        got = a.get(file["url"])
        assert got.headers["content-type"] == "image/png"
        pixels = np.asarray(Image.open(io.BytesIO(got.content)))
        judge = np.asarray(Image.open(io.BytesIO(base64.b64decode(sync.json()["data"][0]["b64_json"]))))
        assert pixels.shape == (64, 64, 3) and np.array_equal(pixels, judge)
        assert b.get(f"/v1/jobs/{job['id']}").status_code == 404  # the caller's key owns it
        bad = a.post("/v1/images/generations", json={**body, "size": "big"}, headers={"Prefer": "respond-async"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "size"  # checked before a job exists
