"""Faults under mixed traffic against a real `omnistage serve tiny-llm tiny-image tiny-omni`:
each stage worker SIGKILLed in turn while streamed chat, images, jobs and realtime voice
sessions run; a client that leaves a stream early. The judge is what real HTTP and websocket
clients see, and the server's own /metrics."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from omnistage.bench.soak_traffic import CHAT, Outcome, Traffic, p99
from omnistage.tests.api.conftest import live_server
from omnistage.tests.reliability.live_workers import holding_replica, worker_pid

STAGES = [
    ("tiny-llm", "llm"),
    ("tiny-image", "text_encoder"),
    ("tiny-image", "denoiser"),
    ("tiny-image", "vae"),
    # the stages a typed realtime question goes through (no audio in: the encoders sit idle)
    ("tiny-omni", "thinker"),
    ("tiny-omni", "talker"),
    ("tiny-omni", "token2wav"),
]
KINDS = ("chat", "image", "job", "realtime")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory, ["tiny-llm", "tiny-image", "tiny-omni"], timeout=600) as server:
        yield server


def wait_restarted(server, pipeline: str, stage: str, old_pid: int, replica: int = 0, timeout: float = 180) -> float:
    """Seconds from now until the stage has a new worker and /ready says 200 again."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        pid = worker_pid(server, pipeline, stage, replica)
        if pid not in (None, old_pid) and httpx.get(f"{server.url}/ready", timeout=10).status_code == 200:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{pipeline}/{stage} not ready {timeout}s after its worker was killed")


def metric(server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in want):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not in /metrics")


def test_sigkill_of_each_worker_fails_only_what_it_held(server):
    traffic = Traffic(server.url, {"chat": 2, "image": 1, "job": 1, "realtime": 1}).start()
    kills: list[tuple[str, str, float, float]] = []  # pipeline, stage, killed at, ready after (s)
    try:
        time.sleep(3.0)
        for pipeline, stage in STAGES:
            replica = holding_replica(server, pipeline, stage, wait_s=3.0) or 0
            pid = worker_pid(server, pipeline, stage, replica)
            assert pid, (pipeline, stage, replica)
            t_kill = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            kills.append((pipeline, stage, t_kill, wait_restarted(server, pipeline, stage, pid, replica)))
            time.sleep(2.0)
    finally:
        outcomes = traffic.stop()
    assert not traffic.errors, traffic.errors[:3]

    def held_at_a_kill(o: Outcome) -> bool:
        # in flight on that pipeline between the kill and the replica's return (a request
        # that arrives before the hub has seen the death is routed to the dead worker too)
        return any(p == o.pipeline and o.start <= t + ready and o.end >= t for p, _, t, ready in kills)

    failed = [o for o in outcomes if not o.ok]
    for o in failed:
        # only requests in flight on the killed worker's pipeline, with a clear retryable error
        assert held_at_a_kill(o), o
        assert o.code == "worker_died", o
        # in-band once a stream began (SSE: 200, a realtime response: 101), else 503 + Retry-After
        assert o.status in (200, 101) or (o.status == 503 and o.retry_after), o
    for kind in KINDS:
        assert sum(o.ok and o.kind == kind for o in outcomes) >= 2, (kind, outcomes)
    # the other pipelines kept answering during each fault (kill -> ready again)
    report = []
    for pipeline, stage, t_kill, ready_s in kills:
        during = [o for o in outcomes if o.pipeline != pipeline and o.end >= t_kill and o.start <= t_kill + ready_s]
        before = [o for o in outcomes if o.pipeline != pipeline and o.end < kills[0][2]]
        assert all(o.ok for o in during), (pipeline, stage, [o for o in during if not o.ok])
        assert during, f"nothing of the other pipelines ran while {pipeline}/{stage} restarted"
        report.append(
            f"{pipeline}/{stage}: ready again after {ready_s:.1f}s; other pipelines p99 "
            f"{p99([o.seconds for o in before]):.2f}s before, {p99([o.seconds for o in during]):.2f}s during "
            f"({len(during)} requests); failed here: {sum(1 for o in failed if o.pipeline == pipeline)}"
        )
    print("\n".join(report))
    # everything works again afterwards
    after = Traffic(server.url, dict.fromkeys(KINDS, 1))
    after.start()
    time.sleep(2.0)
    assert all(o.ok for o in after.stop()), after.outcomes


def test_leaving_a_chat_stream_early_aborts_it_and_frees_its_kv_blocks(server):
    labels = {"pipeline": "tiny-llm", "stage": "llm"}
    aborted = {**labels, "outcome": "aborted"}
    total = metric(server, "omnistage_engine_kv_blocks_total", **labels)
    assert metric(server, "omnistage_engine_kv_blocks_free", **labels) == total
    aborted_before = metric(server, "omnistage_stage_requests_total", **aborted)
    # 2000 tokens take seconds here and EOS is ignored (the random model samples it now and
    # then): leaving after the first few can only end the request by abort
    body = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    freed_after = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(3):
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                events = (line for line in r.iter_lines() if line.startswith("data: "))
                for _ in range(3):  # a few tokens in: the sequence holds blocks now
                    next(events)
            left = time.monotonic()  # the response is closed: the server aborts the request
            while metric(server, "omnistage_engine_kv_blocks_free", **labels) < total:
                assert time.monotonic() - left < 30, "KV blocks still held 30 s after the client left"
                time.sleep(0.02)
            freed_after.append(time.monotonic() - left)
    ended_ok = metric(server, "omnistage_stage_requests_total", **labels, outcome="ok")
    assert metric(server, "omnistage_stage_requests_total", **aborted) == aborted_before + 3, ended_ok
    assert metric(server, "omnistage_stage_inflight_requests", **labels) == 0
    print(f"KV blocks free again {max(freed_after) * 1000:.0f} ms (worst of 3) after the client left")


def test_leaving_an_image_request_early_aborts_it_and_frees_its_denoise_slot(server):
    labels = {"pipeline": "tiny-image", "stage": "denoiser"}
    assert metric(server, "omnistage_engine_requests", **labels) == 0
    aborted_before = metric(server, "omnistage_engine_aborted", **labels)
    steps_before = metric(server, "omnistage_engine_request_steps_total", **labels)
    # 1,000 steps take many seconds here: the client gives up a second in, mid-denoise
    body = {"model": "tiny-image", "prompt": "a red fox", "num_inference_steps": 1000, "seed": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=httpx.Timeout(10, read=1.0))
    left = time.monotonic()  # the connection is closed: the server aborts the request
    assert metric(server, "omnistage_engine_requests", **labels) <= 1
    while metric(server, "omnistage_engine_requests", **labels) > 0:
        assert time.monotonic() - left < 30, "the denoiser still holds the request 30 s after the client left"
        time.sleep(0.02)
    freed_after = time.monotonic() - left
    steps = metric(server, "omnistage_engine_request_steps_total", **labels) - steps_before
    assert 0 < steps < 1000, f"{steps} steps: the request never started or ran to its end"
    assert metric(server, "omnistage_engine_aborted", **labels) == aborted_before + 1
    assert metric(server, "omnistage_stage_inflight_requests", **labels) == 0
    print(f"denoise slot free {freed_after * 1000:.0f} ms after the client left ({steps:.0f} of 1000 steps run)")
