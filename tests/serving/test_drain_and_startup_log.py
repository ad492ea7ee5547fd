"""What a drain timeout and a start-up leave for the client and in the log, on live servers."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest
from openai._streaming import SSEDecoder

from omnistage.graph.loader import load_pipeline
from omnistage.tests.serving.conftest import HERE, start_server

MODEL = "slow-scale"


def _in_flight(url: str, n: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f"omnistage_http_inflight_requests {float(n)}" in httpx.get(f"{url}/metrics").text:
            return
        time.sleep(0.02)
    pytest.fail(f"{n} requests never went in flight")


def test_requests_cut_by_the_drain_timeout_get_503_draining(tmp_path):
    server = start_server([str(HERE / "slow-scale.yaml"), "--drain-timeout", "1"], tmp_path / "server.log")
    results: dict[str, object] = {}
    try:
        server.wait_ready()
        slow = {"inputs": {"x": [1.0]}, "params": {"slow": {"delay_s": 8.0}}}

        def call(key: str, body: dict) -> None:
            try:
                r = httpx.post(f"{server.url}/v1/pipelines/{MODEL}/run", json=body, timeout=60)
                results[key] = (r.status_code, r.headers.get("content-type"), r.text, time.monotonic())
            except Exception as exc:  # noqa: BLE001 - reported by the assertions below
                results[key] = repr(exc)

        threads = [
            threading.Thread(target=call, args=("plain", slow)),
            threading.Thread(target=call, args=("streamed", {**slow, "stream": True})),
        ]
        for t in threads:
            t.start()
        _in_flight(server.url, 2)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert server.proc.wait(30) == 0, server.log()
    finally:
        server.stop()
    for key in ("plain", "streamed"):  # neither had sent a byte: both get the status
        status, content_type, text, answered = results[key]
        assert status == 503, results
        assert answered - started < 6.0  # cut at the 1 s timeout, not after the 8 s stage
        assert content_type == "application/json"
        assert json.loads(text)["error"]["code"] == "draining"
    log = server.log()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
    assert "drain timeout: answering 2 unfinished requests with 503 draining" in log


def test_startup_log_has_one_line_per_stage_and_no_third_party_noise(tiny_server):
    log = tiny_server.log_path.read_text(errors="replace")
    for name in ("tiny-llm", "tiny-image", "tiny-video"):
        spec = load_pipeline(name)
        for stage in spec.stages:
            lines = re.findall(rf"{name}/{stage} \(.*\): ready after", log)
            assert len(lines) == 1, (name, stage, log)
        assert len(re.findall(rf"pipeline '{name}' ready in", log)) == 1
    assert "accelerate" not in log
    assert "Loading weights" not in log and "it/s]" not in log  # no tqdm bars


def test_a_started_stream_cut_by_the_drain_timeout_ends_with_the_error(tmp_path):
    server = start_server(["tiny-llm", "--drain-timeout", "1"], tmp_path / "server.log")
    events: list[str] = []
    try:
        server.wait_ready(timeout=300)
        body = {
            "inputs": {"prompt": "Hello"},
            # 16 sequences of 2000 tokens outlast the 1 s drain timeout even on a quiet machine
            "params": {"llm": {"max_tokens": 2000, "ignore_eos": True, "n": 16, "temperature": 1.0, "seed": 0}},
            "stream": True,
        }
        with httpx.stream("POST", f"{server.url}/v1/pipelines/tiny-llm/run", json=body, timeout=60) as r:
            assert r.status_code == 200
            for event in SSEDecoder().iter_bytes(r.iter_bytes()):  # a text chunk may span data: lines
                events.append(event.data)
                if len(events) == 3:  # the stream has started: now drain
                    server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log()
    finally:
        server.stop()
    assert events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    assert last["error"]["code"] == "draining", last
    tokens = sum(len(json.loads(e)["data"]) for e in events[:-2] if json.loads(e)["port"] == "tokens")
    assert tokens < 2000  # cut, not finished
    assert "Traceback" not in server.log()
