"""The demo's "Images & video" tab in headless Chromium against a live server: the page runs a
job through /v1/jobs, follows its events to 100 %, and shows the result. Judges: the same
job's events read with httpx, its output file decoded with Pillow / PyAV. The server wants an
API key: the page sends it as a header, and on the video's websocket as `?api_key=`."""

from __future__ import annotations

import io
import json

import httpx
import pytest
from PIL import Image

from omnistage.tests.browser.conftest import AUTH, open_demo, page_state, save_screenshot, wait_for

pytestmark = pytest.mark.timeout(600)


FINISHED_IMAGE = (
    "(window.demo.jobs.imageSize && window.demo.jobs.status === 'completed')"
    " || /^(failed|canceled|error)/.test(window.demo.jobs.status)"
)


def fill_job_form(driver, model: str, **fields) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, "job-model")).select_by_value(model)
    for name, value in fields.items():
        box = driver.find_element(By.ID, f"job-{name}")
        box.clear()
        box.send_keys(str(value))
    driver.find_element(By.ID, "job-submit").click()


def sse_event_types(base_url: str, job_id: str) -> list[str]:
    types = []
    with httpx.stream("GET", f"{base_url}/v1/jobs/{job_id}/events", headers=AUTH, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                types.append(json.loads(line[5:])["type"])
    return types


def shown_image_pixels(driver) -> list[int]:
    """The <img> the page shows, drawn on a canvas: its RGBA bytes."""
    return driver.execute_script(
        """
        const img = document.getElementById("job-image");
        const canvas = document.createElement("canvas");
        canvas.width = img.naturalWidth;
        canvas.height = img.naturalHeight;
        const ctx = canvas.getContext("2d");
        ctx.drawImage(img, 0, 0);
        return Array.from(ctx.getImageData(0, 0, canvas.width, canvas.height).data);
        """
    )


def test_image_job_reaches_100_percent_and_shows_the_image(demo_server, open_browser):
    driver = open_browser()
    open_demo(driver, demo_server, "jobs")
    fill_job_form(driver, "tiny-image", prompt="a green pyramid", width=64, height=48, steps=6, seed=3)
    wait_for(driver, FINISHED_IMAGE, 300, "the image")
    state = page_state(driver, "window.demo.jobs")
    save_screenshot(driver, "demo-jobs.png")

    assert state["error"] is None and state["status"] == "completed"
    assert state["percent"] == 100
    assert page_state(driver, "document.getElementById('job-progress').value") == 100
    # the page saw the job's whole event log, as an independent SSE client reads it afterwards
    assert state["events"] == sse_event_types(demo_server.url, state["jobId"])
    assert state["progressEvents"] == state["events"].count("progress") >= 1

    job = httpx.get(f"{demo_server.url}/v1/jobs/{state['jobId']}", headers=AUTH).json()
    assert job["status"] == "completed"
    (file,) = job["outputs"]["image"]["files"]
    assert state["imageUrl"] == file["url"]
    png = Image.open(io.BytesIO(httpx.get(demo_server.url + file["url"], headers=AUTH).content)).convert("RGBA")
    assert state["imageSize"] == [64, 48] == list(png.size)
    assert shown_image_pixels(driver) == list(png.tobytes())


def test_video_job_plays_from_its_stream(demo_server, open_browser):
    av = pytest.importorskip("av")
    driver = open_browser()
    open_demo(driver, demo_server, "jobs")
    fill_job_form(driver, "tiny-video", prompt="waves", width=32, height=32, steps=3, frames=17, seed=2)
    wait_for(driver, "/^(completed|failed|canceled|error)/.test(window.demo.jobs.status)", 300, "the video job")
    wait_for(driver, "document.getElementById('job-video').readyState >= 1", 30, "the video's metadata")
    # segments still queued behind an append in progress go in after the completed event
    wait_for(driver, "!window.demo.jobs.streamed || window.demo.jobs.streamEnded", 30, "the stream's last append")
    state = page_state(driver, "window.demo.jobs")

    assert state["error"] is None and state["status"] == "completed" and state["percent"] == 100
    assert state["streamed"], "the page did not play the fMP4 stream through Media Source Extensions"
    assert state["streamEnded"]
    # a keyed browser can open the job's websocket (the key rides as ?api_key=)
    assert state["videoTransport"] == "websocket", "WS /v1/jobs/{id}/stream refused the page's ?api_key="
    job = httpx.get(f"{demo_server.url}/v1/jobs/{state['jobId']}", headers=AUTH).json()
    (file,) = job["outputs"]["video"]["files"]
    mp4 = httpx.get(demo_server.url + file["url"], headers=AUTH).content
    # the SourceBuffer took the stream's segments, which concatenated are the job's file
    assert state["segments"] >= 1
    assert state["bytesAppended"] == len(mp4)
    frames = sum(1 for _ in av.open(io.BytesIO(mp4)).decode(video=0))
    assert frames == 17
    video = page_state(
        driver,
        "(v => ({w: v.videoWidth, h: v.videoHeight, duration: v.duration}))(document.getElementById('job-video'))",
    )
    assert (video["w"], video["h"]) == (32, 32)
    container = av.open(io.BytesIO(mp4))
    stream = container.streams.video[0]
    expected = float(stream.frames / stream.average_rate) if stream.frames else 17 / float(stream.average_rate)
    assert video["duration"] == pytest.approx(expected, abs=0.1)


def test_cancel_button_cancels_the_running_job(demo_server, open_browser):
    from selenium.webdriver.common.by import By

    driver = open_browser()
    open_demo(driver, demo_server, "jobs")
    fill_job_form(driver, "tiny-image", prompt="slow", width=64, height=64, steps=500, seed=1)
    wait_for(driver, "window.demo.jobs.progressEvents >= 1", 120, "the job running")
    driver.find_element(By.ID, "job-cancel").click()
    wait_for(driver, "/^(completed|failed|canceled|error)/.test(window.demo.jobs.status)", 120, "the job's end")
    state = page_state(driver, "window.demo.jobs")
    assert state["status"] == "canceled" and state["events"][-1] == "canceled"
    assert state["percent"] < 100 and state["imageSize"] is None
    job = httpx.get(f"{demo_server.url}/v1/jobs/{state['jobId']}", headers=AUTH).json()
    assert job["status"] == "canceled"


def test_a_refused_job_shows_the_servers_error(demo_server, open_browser):
    driver = open_browser()
    open_demo(driver, demo_server, "jobs")
    # more steps than the denoiser takes (max_inference_steps): refused when submitted (400)
    fill_job_form(driver, "tiny-image", prompt="too long", width=64, height=64, steps=5000, seed=1)
    wait_for(driver, "/^(completed|failed|canceled|error)/.test(window.demo.jobs.status)", 120, "the job's end")
    state = page_state(driver, "window.demo.jobs")
    body = {
        "model": "tiny-image",
        "inputs": {"prompt": "too long"},
        "params": {"denoiser": {"width": 64, "height": 64, "num_inference_steps": 5000, "seed": 1}},
    }
    refused = httpx.post(f"{demo_server.url}/v1/jobs", json=body, headers=AUTH)
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "num_inference_steps" in message
    # the page shows the server's own message
    assert state["error"] == message
    assert state["status"] == f"error: {message}"
    assert page_state(driver, "document.getElementById('job-submit').disabled") is False
