"""OpenAI's /v1/videos over jobs, driven by the official `openai` client against a real server."""

from __future__ import annotations

import io
import sqlite3
import time
from collections import Counter

import av
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from omnistage.bench.soak import describe_fd, fd_targets
from omnistage.serving.jobs.schema import migration_statements
from omnistage.serving.jobs.store import MIGRATIONS, SQLiteJobStore
from omnistage.tests.jobs.conftest import jobs_env, start_jobs_server

# the client warns that OpenAI's hosted video API is to close; this server's is not
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


@pytest.fixture(scope="module")
def video_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("videos")
    server = start_jobs_server(["tiny-video"], base / "server.log", jobs_env(base / "jobs"))
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()


def _frames(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def test_create_poll_download_decode_delete(video_server):
    client = openai.OpenAI(base_url=f"{video_server.url}/v1", api_key="unused", max_retries=0)
    video = client.videos.create(model="tiny-video", prompt="a cat walks", seconds="0.5", size="32x32")
    assert video.object == "video" and video.status in ("queued", "in_progress")
    done = client.videos.poll(video.id, poll_interval_ms=100)
    assert done.status == "completed" and done.progress == 100, done
    assert done.size == "32x32" and done.seconds == "0.5" and done.completed_at >= done.created_at
    content = client.videos.download_content(video.id, variant="video").read()
    frames = _frames(content)
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)  # 0.5 s at 16 fps -> 4k+1 = 9 frames
    thumb = np.asarray(Image.open(io.BytesIO(client.videos.download_content(video.id, variant="thumbnail").read())))
    assert thumb.shape == (32, 32, 3)
    assert np.array_equal(thumb, frames[0])  # lossless WebP of the first decoded frame
    # range requests for seeking
    part = httpx.get(f"{video_server.url}/v1/videos/{video.id}/content", headers={"Range": "bytes=0-15"})
    assert part.status_code == 206 and part.content == content[:16]
    listed = client.videos.list()
    assert video.id in [v.id for v in listed.data]
    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_a_seed_makes_a_video_reproducible(video_server):
    """The extra fields (seed, num_inference_steps, ...) reach the stages, as form fields too."""
    client = openai.OpenAI(base_url=f"{video_server.url}/v1", api_key="unused", max_retries=0)

    def frames(seed: str) -> np.ndarray:
        extra = {"seed": seed, "num_inference_steps": "2", "negative_prompt": "blurry"}
        video = client.videos.create(model="tiny-video", prompt="a cat", seconds="0.25", size="32x32", extra_body=extra)
        assert client.videos.poll(video.id, poll_interval_ms=100).status == "completed"
        return np.stack(_frames(client.videos.download_content(video.id).read()))

    first, again, other = frames("5"), frames("5"), frames("6")
    # no size or seconds asked: the video shows the model's (tiny-wan: 32x32, 9 frames at 16 fps)
    shown = client.videos.create(model="tiny-video", prompt="a cat", extra_body={"num_inference_steps": 1})
    assert (shown.size, shown.seconds) == ("32x32", "0.5")
    assert (
        len(_frames(client.videos.download_content(client.videos.poll(shown.id, poll_interval_ms=100).id).read())) == 9
    )
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    r = httpx.post(f"{video_server.url}/v1/videos", data={"prompt": "x", "seed": "1.5"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"


def test_video_errors(video_server):
    client = openai.OpenAI(base_url=f"{video_server.url}/v1", api_key="unused", max_retries=0)
    card = httpx.get(f"{video_server.url}/v1/models/tiny-video", timeout=30).json()
    assert card["serves"] == ["videos"] and card["modalities"]["videos"] == {"input": ["text"], "output": ["video"]}
    with pytest.raises(openai.NotFoundError) as err:
        client.videos.create(model="sora-2", prompt="x")
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(model="tiny-video", prompt="x", size="big")
    assert err.value.body["param"] == "size"
    # refused when created, as the stages would refuse them when the job ran
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(model="tiny-video", prompt="x", seconds="100", size="32x32")
    assert err.value.body["param"] == "seconds" and "frames" in err.value.body["message"]
    for seconds in ("inf", "nan", "-1", "0"):
        with pytest.raises(openai.BadRequestError) as err:
            client.videos.create(model="tiny-video", prompt="x", seconds=seconds, size="32x32")
        assert err.value.body["param"] == "seconds" and "positive number" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(model="tiny-video", prompt="x", size="720x1280")
    assert err.value.body["param"] == "size"
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("job_nope")


def test_schema_version_1_database_migrates_to_the_current_one(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(";\n".join(migration_statements("sqlite", 1)) + ";\nPRAGMA user_version = 1;")
    db.execute(
        "INSERT INTO jobs (id, model, status, priority, inputs, params, metadata, output_format, created_at) "
        "VALUES ('job_old', 'tiny-image', 'queued', 0, '{}', '{}', '{}', '{}', 1.0)"
    )
    db.commit()
    db.close()
    store = SQLiteJobStore(path)
    try:
        assert store.schema_version == len(MIGRATIONS) == 4
        job = store.get_job("job_old")
        assert job.api == "jobs" and job.status.value == "queued" and job.request_digest is None
        assert store.list_jobs(10, api="videos") == []
    finally:
        store.close()


def test_websocket_streams_fmp4_segments_before_the_job_completes(video_server):
    import asyncio
    import json
    import time

    import websockets

    params = {"height": 96, "width": 96, "num_frames": 41, "num_inference_steps": 2, "seed": 5}
    body = {"inputs": {"prompt": "waves"}, "params": {s: dict(params) for s in ("text_encoder", "denoiser", "vae")}}
    with httpx.Client(base_url=video_server.url, timeout=120) as client:
        job = client.post("/v1/jobs", json={"model": "tiny-video", **body}).json()

        async def receive():
            frames = []  # (arrival time, kind, payload)
            url = f"ws://127.0.0.1:{video_server.port}/v1/jobs/{job['id']}/stream"
            async with websockets.connect(url) as ws:
                async for message in ws:
                    kind = "binary" if isinstance(message, bytes) else "text"
                    frames.append((time.time(), kind, message if kind == "binary" else json.loads(message)))
            return frames

        received = asyncio.run(receive())
        done = client.get(f"/v1/jobs/{job['id']}").json()
        assert done["status"] == "completed"
        segments = [(t, m) for t, kind, m in received if kind == "binary"]
        events = [m["type"] for _, kind, m in received if kind == "text"]
        assert events[0] == "queued" and events[-1] == "completed" and "progress" in events
        # 41 frames in temporal chunks of 1 latent frame: a header+first fragment, then more
        assert len(segments) >= 3
        print("segment arrivals before the job finished (s):", [round(done["finished_at"] - t, 3) for t, _ in segments])
        assert segments[0][0] < done["finished_at"] - 0.1, "the first segment arrived only when the job ended"
        streamed = b"".join(m for _, m in segments)
        (file,) = done["outputs"]["video"]["files"]
        finished = client.get(file["url"]).content
        decoded = _frames(streamed)
        assert len(decoded) == 41
        assert all(np.array_equal(a, b) for a, b in zip(decoded, _frames(finished), strict=True))
        # the judge for the pixels: the pipeline's raw frames from the synchronous run route
        raw = client.post("/v1/pipelines/tiny-video/run", json=body).json()["outputs"]["video"]
        raw = np.asarray(raw, dtype=np.float64)
        assert raw.shape == (41, 96, 96, 3)
        assert np.abs(np.stack(decoded).astype(np.float64) - raw).mean() < 4.0  # H.264 at crf 18


def test_chunked_http_download_starts_before_the_job_completes(video_server):
    import time

    params = {"height": 96, "width": 96, "num_frames": 41, "num_inference_steps": 2, "seed": 6}
    with httpx.Client(base_url=video_server.url, timeout=120) as client:
        job = client.post(
            "/v1/jobs", json={"model": "tiny-video", "inputs": {"prompt": "rain"}, "params": {"denoiser": params}}
        ).json()
        arrivals, data = [], b""
        with client.stream("GET", f"/v1/jobs/{job['id']}/stream") as response:
            assert response.status_code == 200 and response.headers["content-type"] == "video/mp4"
            for chunk in response.iter_raw():
                arrivals.append(time.time())
                data += chunk
        done = client.get(f"/v1/jobs/{job['id']}").json()
        assert done["status"] == "completed"
        assert arrivals[0] < done["finished_at"] - 0.1, "the download began only when the job ended"
        assert data == client.get(done["outputs"]["video"]["files"][0]["url"]).content
        assert len(_frames(data)) == 41
        # a finished job streams its whole file
        assert client.get(f"/v1/jobs/{job['id']}/stream").content == data


def test_leaving_the_websocket_stream_early_leaves_the_job_running_and_holds_nothing(video_server):
    import asyncio

    import websockets

    pid = video_server.proc.pid
    before = sorted(fd_targets(pid))
    params = {"height": 96, "width": 96, "num_frames": 41, "num_inference_steps": 2, "seed": 7}
    body = {"inputs": {"prompt": "sand"}, "params": {s: dict(params) for s in ("text_encoder", "denoiser", "vae")}}
    with httpx.Client(base_url=video_server.url, timeout=120) as client:
        job = client.post("/v1/jobs", json={"model": "tiny-video", **body}).json()
    url = f"ws://127.0.0.1:{video_server.port}/v1/jobs/{job['id']}/stream"

    async def leave_after_the_first_segment() -> bool:
        async with websockets.connect(url) as ws:
            async for message in ws:
                if isinstance(message, bytes):
                    return True  # leaves: the context closes the connection mid-stream
        return False

    async def stay() -> bytes:
        async with websockets.connect(url) as ws:
            return b"".join([m async for m in ws if isinstance(m, bytes)])

    async def both() -> tuple[bool, bytes]:
        return await asyncio.gather(leave_after_the_first_segment(), stay())

    left_mid_stream, streamed = asyncio.run(both())
    assert left_mid_stream
    with httpx.Client(base_url=video_server.url, timeout=120) as client:
        done = client.get(f"/v1/jobs/{job['id']}").json()
        # leaving a stream is not a cancel: the job ran to the end for the client that stayed
        assert done["status"] == "completed", done
        finished = client.get(done["outputs"]["video"]["files"][0]["url"]).content
    assert streamed == finished and len(_frames(streamed)) == 41

    # the server closed its side of both connections and holds no other descriptor for them
    # (one it had before may have closed meanwhile: an idle keep-alive connection of an
    # earlier test)
    def added() -> list[str]:
        return list((Counter(fd_targets(pid)) - Counter(before)).elements())

    deadline = time.monotonic() + 15
    while added() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not added(), [describe_fd(pid, t) for t in added()]
