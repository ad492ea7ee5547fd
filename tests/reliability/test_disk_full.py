"""Disk full under the jobs directory (the SQLite job store and the output files) of a real
`omnistage serve tiny-image`: a small tmpfs mounted by the test (root only) is filled up.
Submissions get a clear 507 `storage_full`, never a 500; a job running when the disk fills
ends failed with `storage_full` (stored once there is room again); the server keeps answering
what needs no disk; the store passes SQLite's integrity check afterwards."""

from __future__ import annotations

import errno
import sqlite3
import subprocess
import time

import httpx
import pytest

from omnistage.bench.soak_traffic import IMAGE, JOB
from omnistage.tests.api.conftest import live_server
from omnistage.tests.jobs.conftest import wait_status

ENDED = ("completed", "failed", "canceled")


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a small tmpfs needs root: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path) -> None:
    """Write until the filesystem is full."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def test_full_disk_under_the_job_store_is_a_clear_error_and_no_corruption(small_fs, tmp_path_factory):
    jobs_dir = small_fs / "jobs"
    args = ["tiny-image", "--drain-timeout", "3"]  # jobs stuck on the full disk would hold the drain
    with live_server(tmp_path_factory, args, env={"OMNISTAGE_JOBS_DIR": str(jobs_dir)}) as server:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            first = client.post("/v1/jobs", json=JOB)
            assert first.status_code == 202, first.text
            assert wait_status(client, first.json()["id"], ENDED)["status"] == "completed"
            long_run = {"width": 64, "height": 64, "num_inference_steps": 1000}  # the most a request may ask
            running = client.post("/v1/jobs", json={**JOB, "params": {"denoiser": long_run}}).json()["id"]
            deadline = time.monotonic() + 120
            while (job := client.get(f"/v1/jobs/{running}").json())["progress"]["done"] < 1:
                assert time.monotonic() < deadline and job["status"] in ("queued", "in_progress"), job
                time.sleep(0.1)
            fill(small_fs / "filler")
            answers = []
            for i in range(20):  # SQLite may still fit a few rows in pages it already has
                r = client.post("/v1/jobs", json={**JOB, "inputs": {"prompt": f"full {i}"}})
                answers.append(r)
                if r.status_code == 507:
                    break
            codes = [(r.status_code, r.json().get("error", {}).get("code")) for r in answers]
            assert all(c in ((202, None), (507, "storage_full")) for c in codes), codes
            assert codes[-1] == (507, "storage_full"), codes
            refused = answers[-1]
            assert refused.headers.get("retry-after") and "storage is full" in refused.json()["error"]["message"]
            # what needs no disk still works
            assert client.get("/health").status_code == 200
            assert client.post("/v1/images/generations", json=IMAGE).status_code == 200
            # an image answered by URL is a file: refused like a job, no partial file kept
            by_url = client.post("/v1/images/generations", json={**IMAGE, "response_format": "url"})
            assert by_url.status_code == 507 and by_url.json()["error"]["code"] == "storage_full", by_url.text
            assert not [p.name for p in (jobs_dir / "images").glob("*")], "a partial image file was kept"
            assert client.get(f"/v1/jobs/{first.json()['id']}").json()["status"] == "completed"
            ended = wait_status(client, running, ENDED)
            assert ended["status"] == "failed" and ended["error"]["code"] == "storage_full", ended
            assert "storage is full" in ended["error"]["message"]
            (small_fs / "filler").unlink()
            # with room again its failure is stored: the event log (read from the store) ends
            events = client.get(f"/v1/jobs/{running}/events", timeout=30).text
            assert "event: failed" in events
    store = sqlite3.connect(f"file:{jobs_dir / 'jobs.sqlite3'}?mode=ro", uri=True)
    try:
        assert store.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        statuses = dict(store.execute("SELECT id, status FROM jobs").fetchall())
    finally:
        store.close()
    assert statuses[first.json()["id"]] == "completed"
    assert statuses[running] == "failed"
