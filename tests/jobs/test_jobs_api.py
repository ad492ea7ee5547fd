"""/v1/jobs against a real `omnistage serve` (tiny-image, one running job per model)."""

from __future__ import annotations

import io
import json
import re
import threading

import httpx
import numpy as np
from PIL import Image

from omnistage.tests.jobs.conftest import image_job, sse_events, wait_for, wait_status


def test_job_runs_and_its_file_equals_the_synchronous_run(jobs_server):
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        created = client.post("/v1/jobs", json=image_job(steps=4, seed=7, metadata={"tag": "a"}))
        assert created.status_code == 202, created.text
        job = created.json()
        assert job["object"] == "job" and job["status"] in ("queued", "in_progress")
        assert created.headers["location"] == f"/v1/jobs/{job['id']}"
        done = wait_status(client, job["id"], ("completed", "failed"))
        assert done["status"] == "completed", done
        assert done["progress"] == {"done": 4, "total": 4, "percent": 100}
        assert done["created_at"] <= done["started_at"] <= done["finished_at"] < done["expires_at"]
        assert done["expires_at"] - done["finished_at"] == 3600
        assert done["metadata"] == {"tag": "a"} and done["queue_position"] is None
        (file,) = done["outputs"]["image"]["files"]
        got = client.get(file["url"])
        assert got.status_code == 200 and got.headers["content-type"] == "image/png"
        assert len(got.content) == file["bytes"]
        # the judge: the same request answered synchronously by the generic run route
        sync = client.post(
            "/v1/pipelines/tiny-image/run",
            json={k: v for k, v in image_job(steps=4, seed=7).items() if k != "model"},
            headers={"Accept": "image/png"},
        )
        assert sync.status_code == 200
        a = np.asarray(Image.open(io.BytesIO(got.content)))
        b = np.asarray(Image.open(io.BytesIO(sync.content)))
        assert a.shape == (64, 64, 3) and np.array_equal(a, b)
        # HTTP range requests (video seeking uses these)
        part = client.get(file["url"], headers={"Range": "bytes=10-49"})
        assert part.status_code == 206 and part.content == got.content[10:50]
        assert part.headers["content-range"] == f"bytes 10-49/{len(got.content)}"
        assert client.get(f"/v1/jobs/{job['id']}/outputs/nothing.png").status_code == 404
        listed = client.get("/v1/jobs", params={"limit": 100}).json()
        assert job["id"] in [j["id"] for j in listed["data"]]


def test_a_long_job_logs_one_progress_event_per_percent(jobs_server):
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        job = client.post("/v1/jobs", json=image_job(steps=250)).json()
        wait_status(client, job["id"], ("completed",), timeout=300)
        events = sse_events(client.get(f"/v1/jobs/{job['id']}/events").text)
    done = [e[2]["done"] for e in events if e[1] == "progress"]
    # the first step, each percent reached (250 steps: every 2.5 steps), the last step
    expected = [1] + [s for s in range(2, 251) if 100 * s // 250 != 100 * (s - 1) // 250]
    assert done == expected, done
    assert len(done) == 101


def test_idempotency_key_returns_the_same_job(jobs_server):
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        headers = {"Idempotency-Key": "same-key-1"}
        first = client.post("/v1/jobs", json=image_job(), headers=headers)
        second = client.post("/v1/jobs", json=image_job(), headers=headers)
        assert first.status_code == second.status_code == 202
        assert first.json()["id"] == second.json()["id"]
        assert second.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers
        # the key with another request is refused, not answered with the first request's job
        other = client.post("/v1/jobs", json=image_job(seed=99), headers=headers)
        assert other.status_code == 422, other.text
        error = other.json()["error"]
        assert error["code"] == "idempotency_key_reused" and error["param"] == "Idempotency-Key"
        assert first.json()["id"] in error["message"]
        wait_status(client, first.json()["id"], ("completed",))
        ids = [j["id"] for j in client.get("/v1/jobs", params={"limit": 100}).json()["data"]]
        assert ids.count(first.json()["id"]) == 1


def test_events_stream_in_order_and_resume_after_last_event_id(jobs_server):
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        job = client.post("/v1/jobs", json=image_job(steps=5)).json()
        with client.stream("GET", f"/v1/jobs/{job['id']}/events") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            body = response.read().decode()
        events = sse_events(body)
        types = [e[1] for e in events]
        assert types[0] == "queued" and types[1] == "started" and types[-2:] == ["output", "completed"]
        progress = [e[2]["done"] for e in events if e[1] == "progress"]
        assert progress == [1, 2, 3, 4, 5]
        ids = [int(e[0]) for e in events]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        cut = events[3][0]
        resumed = client.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": cut})
        assert sse_events(resumed.text) == events[4:]


def _denoiser_inflight(client: httpx.Client) -> float:
    metrics = client.get("/metrics").text
    match = re.search(r'omnistage_stage_inflight_requests\{[^}]*stage="denoiser"[^}]*\} ([0-9.]+)', metrics)
    assert match, metrics[:2000]
    return float(match.group(1))


def test_cancel_mid_denoise_frees_the_slot_and_a_queued_job_never_starts(jobs_server):
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        running = client.post("/v1/jobs", json=image_job(steps=400)).json()
        queued = client.post("/v1/jobs", json=image_job(steps=4)).json()
        later = client.post("/v1/jobs", json=image_job(steps=4)).json()
        wait_for(lambda: client.get(f"/v1/jobs/{running['id']}").json()["progress"]["done"] >= 2, what="progress")
        assert client.get(f"/v1/jobs/{queued['id']}").json()["queue_position"] == 0
        assert client.get(f"/v1/jobs/{later['id']}").json()["queue_position"] == 1
        assert _denoiser_inflight(client) == 1
        # cancel the queued one first: it must never start, even once the running one goes
        canceled = client.delete(f"/v1/jobs/{queued['id']}")
        assert canceled.status_code == 200 and canceled.json()["status"] == "canceled"
        stopped = client.delete(f"/v1/jobs/{running['id']}").json()
        assert stopped["status"] == "canceled" and stopped["progress"]["done"] < 400
        assert wait_status(client, later["id"], ("completed",))["status"] == "completed"
        never = client.get(f"/v1/jobs/{queued['id']}").json()
        assert never["started_at"] is None and never["attempts"] == 0
        types = [e[1] for e in sse_events(client.get(f"/v1/jobs/{queued['id']}/events").text)]
        assert types == ["queued", "canceled"]
        types = [e[1] for e in sse_events(client.get(f"/v1/jobs/{running['id']}/events").text)]
        assert types[-1] == "canceled" and "completed" not in types
        assert _denoiser_inflight(client) == 0


def test_bad_input_gets_openai_style_errors(jobs_server):
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:

        def error(response, status):
            assert response.status_code == status, response.text
            body = response.json()["error"]
            assert set(body) == {"message", "type", "param", "code"}
            return body

        assert error(client.post("/v1/jobs", json=image_job(model="nope")), 404)["param"] == "model"
        bad = error(client.post("/v1/jobs", json={**image_job(), "inputs": {"prompt": "x", "image": [1]}}), 400)
        assert bad["param"] == "inputs"
        assert error(client.post("/v1/jobs", json={"model": "tiny-image"}), 400)["param"] == "inputs"
        for url in ("http://10.1.2.3/hook", "http://169.254.169.254/latest", "http://[::1]:9/x", "ftp://x/y"):
            body = error(client.post("/v1/jobs", json=image_job(webhook={"url": url})), 400)
            assert body["param"] == "webhook.url" and body["code"] == "webhook_url_not_allowed", url
        body = error(client.post("/v1/jobs", json=image_job(webhook={"url": "http://x.test/", "events": ["x"]})), 400)
        assert body["param"] == "webhook.events"
        # what the stages would refuse when the job ran is refused when it is submitted, and
        # no job is stored: a size past the checkpoint's range, a cap of the denoiser's
        listed = len(client.get("/v1/jobs", params={"limit": 100}).json()["data"])
        too_wide = image_job()
        too_wide["params"]["denoiser"]["width"] = 1000
        body = error(client.post("/v1/jobs", json=too_wide), 400)
        assert body["param"] == "width" and "denoiser" in body["message"] and "<= 256" in body["message"]
        odd = image_job()
        odd["params"]["denoiser"]["height"] = 66
        assert "e.g. 64" in error(client.post("/v1/jobs", json=odd), 400)["message"]
        assert error(client.post("/v1/jobs", json=image_job(steps=5000)), 400)["param"] == "num_inference_steps"
        prefer = {"Prefer": "respond-async"}
        sized = {"model": "tiny-image", "prompt": "a", "size": "1000x1000"}
        assert error(client.post("/v1/images/generations", json=sized, headers=prefer), 400)["param"] == "size"
        assert len(client.get("/v1/jobs", params={"limit": 100}).json()["data"]) == listed
        huge = {**image_job(), "inputs": {"prompt": "x" * (33 * 1024 * 1024)}}
        assert error(client.post("/v1/jobs", json=huge), 413)["code"] == "body_too_large"
        job = client.post("/v1/jobs", json=image_job()).json()
        wait_status(client, job["id"], ("completed",))
        assert error(client.delete(f"/v1/jobs/{job['id']}"), 409)["code"] == "job_finished"
        assert error(client.get("/v1/jobs/job_missing"), 404)["code"] == "job_not_found"
        missing = error(client.get(f"/v1/jobs/{job['id']}/outputs/nope.png"), 404)
        (file,) = client.get(f"/v1/jobs/{job['id']}").json()["outputs"]["image"]["files"]
        assert missing["code"] == "output_not_found" and file["url"].rsplit("/", 1)[1] in missing["message"]
        assert error(client.get("/v1/jobs", params={"after": "job_bogus"}), 400)["param"] == "after"


def test_a_burst_waits_in_the_store_and_every_job_completes(jobs_server):
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        ids: list[str] = []

        def submit(n):
            for i in range(n):
                ids.append(client.post("/v1/jobs", json=image_job(steps=2, seed=i)).json()["id"])

        threads = [threading.Thread(target=submit, args=(10,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(ids)) == 30
        positions = [client.get(f"/v1/jobs/{i}").json()["queue_position"] for i in ids]
        assert max(p for p in positions if p is not None) >= 10
        for job_id in ids:
            assert wait_status(client, job_id, ("completed", "failed"))["status"] == "completed"


def test_an_output_event_s_url_answers_at_once(jobs_server):
    """A client that fetches the file as soon as the `output` event names it (the demo page
    does) gets it: the event comes before the job's `completed` event."""
    with httpx.Client(base_url=jobs_server.url, timeout=60) as client:
        for seed in range(3):
            job = client.post("/v1/jobs", json=image_job(seed=10 + seed)).json()
            with client.stream("GET", f"/v1/jobs/{job['id']}/events") as response:
                for line in response.iter_lines():
                    event = json.loads(line[5:]) if line.startswith("data:") else {}
                    if event.get("type") == "output":
                        url = event["urls"][0]["url"]
                        got = client.get(url)
                        assert got.status_code == 200 and got.content[:8] == b"\x89PNG\r\n\x1a\n", got.text[:300]
                        break
                else:
                    raise AssertionError("no output event")
