"""Overload at three times capacity against a real `omnistage serve`: the excess is answered
at once with 503 `overloaded` and Retry-After, never a hang; admitted requests keep a latency
bounded by the queue they joined; after the burst, latency is back to normal within seconds.
Capacity and normal latency are measured in the same test (one stage that sleeps 0.2 s per
request, one at a time: 5 requests per second)."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import pytest

from omnistage.tests.api.conftest import live_server

SERVICE_S = 0.2
QUEUE = 4  # limits.max_queued_requests

YAML = f"""
name: overload
inputs: {{x: tensor}}
outputs: {{y: tensor}}
limits: {{max_queued_requests: {QUEUE}}}
stages:
  s:
    kind: torch_module
    params:
      factory: omnistage.runtime.testmodules:Sleeper
      pass_params: true
      inputs: {{x: tensor}}
      outputs: {{y: tensor}}
    batching: {{policy: none}}
edges:
  - {{from: inputs.x, to: s.x}}
  - {{from: s.y, to: outputs.y}}
"""
BODY = {"inputs": {"x": [1.0, 2.0]}, "params": {"s": {"delay": SERVICE_S}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tmp_path_factory.mktemp("overload") / "overload.yaml"
    config.write_text(YAML)
    with live_server(tmp_path_factory, [str(config)]) as server:
        yield server


def one(client: httpx.Client) -> tuple[int, float, str | None, str | None]:
    t0 = time.monotonic()
    r = client.post("/v1/pipelines/overload/run", json=BODY)
    code = None if r.status_code == 200 else r.json()["error"]["code"]
    if r.status_code == 200:
        assert r.json()["outputs"]["y"] == BODY["inputs"]["x"]
    return r.status_code, time.monotonic() - t0, code, r.headers.get("retry-after")


def test_three_times_capacity_is_refused_at_once_and_recovers(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        normal = statistics.median(one(client)[1] for _ in range(5))
    capacity = 1 / SERVICE_S
    rate, seconds = 3 * capacity, 4.0
    results: list = []
    lock = threading.Lock()

    def fire():
        with httpx.Client(base_url=server.url, timeout=60) as c:
            try:
                res = one(c)
            except httpx.HTTPError as exc:  # a hang or a dropped connection is a finding
                res = (0, 60.0, type(exc).__name__, None)
        with lock:
            results.append(res)

    threads = []
    t0 = time.monotonic()
    for i in range(int(rate * seconds)):  # open loop: arrivals do not wait for answers
        time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        threads.append(threading.Thread(target=fire))
        threads[-1].start()
    burst_end = time.monotonic()
    for t in threads:
        t.join(90)
    assert len(results) == len(threads)
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    assert refused and all(r[0] == 503 and r[2] == "overloaded" and r[3] for r in refused), refused
    # refused at once: faster than any admitted request, which sleeps SERVICE_S at least
    assert max(r[1] for r in refused) < statistics.median(r[1] for r in ok), (refused, ok)
    # admitted work waits behind at most QUEUE requests, never an unbounded backlog
    assert max(r[1] for r in ok) < (QUEUE + 1) * normal * 1.5 + 1.0, (normal, sorted(r[1] for r in ok))
    assert len(ok) >= 0.5 * capacity * seconds, len(ok)
    # recovery: once the queue drains, a lone request takes its normal time again
    with httpx.Client(base_url=server.url, timeout=60) as client:
        while True:
            status, took, _, _ = one(client)
            if status == 200 and took < 1.5 * normal + 0.1:
                break
            assert time.monotonic() - burst_end < 10, "latency not back to normal 10 s after the burst"
    recovered = time.monotonic() - burst_end
    print(
        f"3x capacity for {seconds:.0f}s: {len(ok)} served (max {max(r[1] for r in ok):.2f}s), "
        f"{len(refused)} refused (max {max(r[1] for r in refused) * 1000:.0f} ms); normal {normal:.2f}s, "
        f"back to normal {recovered:.1f}s after the burst"
    )
