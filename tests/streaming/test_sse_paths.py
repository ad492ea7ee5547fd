"""HTTP paths of the run route that only show with a real model behind `omnistage serve`:
an error inside a stream that already started, a client that leaves mid-stream, bad inputs
and timeouts. Clients: httpx (raw SSE) against tiny-llm; engine figures from /metrics."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

RUN = "/v1/pipelines/tiny-llm/run"
LONG = {"llm": {"temperature": 0.0, "max_tokens": 2000, "ignore_eos": True}}
BUSY = {"llm": {"temperature": 1.0, "seed": 0, "n": 16, "max_tokens": 2000, "ignore_eos": True}}


def engine_stats(url: str) -> dict[str, float]:
    """The tiny-llm stage's engine figures (summed over replicas) from /metrics."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name.startswith("omnistage_engine_") and s.labels.get("pipeline") == "tiny-llm":
                key = s.name[len("omnistage_engine_") :]
                out[key] = out.get(key, 0.0) + s.value
    return out


def sse_events(lines):
    for line in lines:
        if line.startswith("data: "):
            yield None if line == "data: [DONE]" else json.loads(line[len("data: ") :])


def assert_openai_error(err: dict, code: str, param=None) -> None:
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == code and err["message"]
    if param is not None:
        assert err["param"] == param


def test_error_after_the_first_byte_is_reported_in_band(llm_server):
    """A deadline that passes mid-generation: the 200 stream carries data, then one error
    event in OpenAI's shape, then [DONE]."""
    body = {"inputs": {"prompt": "Once upon a time"}, "params": LONG, "stream": True, "timeout": 0.5}
    with httpx.stream("POST", llm_server.url + RUN, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = list(sse_events(resp.iter_lines()))
    assert events[-1] is None  # [DONE] still closes the stream
    data = [e for e in events[:-1] if "error" not in e]
    errors = [e for e in events[:-1] if "error" in e]
    assert len(data) >= 3 and any(e["port"] == "text" and e["data"] for e in data)
    assert len(errors) == 1 and events[-2] is errors[0]
    assert_openai_error(errors[0]["error"], "deadline_exceeded")
    assert errors[0]["error"]["type"] == "server_error"


def test_client_leaving_mid_stream_frees_the_engine(llm_server):
    url = llm_server.url
    idle = engine_stats(url)
    assert idle["running"] == 0 and idle["kv_blocks_free"] == idle["kv_blocks_total"]
    # 16 sequences of 2000 tokens keep the engine busy for seconds even on a quiet machine (one
    # sequence of 2000 takes under a second there, so the busy check below could miss it).
    body = {"inputs": {"prompt": "Once upon a time"}, "params": BUSY, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url + RUN, json=body) as resp:
            assert resp.status_code == 200
            events = sse_events(resp.iter_lines())
            for _ in range(5):
                assert next(events)["port"] in ("tokens", "text")
            # workers publish engine figures at most every ENGINE_STATS_EVERY_S: poll for them
            deadline = time.monotonic() + 3
            while (busy := engine_stats(url))["running"] != 16 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert busy["running"] == 16 and busy["kv_blocks_free"] < busy["kv_blocks_total"], busy
            resp.close()  # the client leaves mid-stream
    deadline = time.monotonic() + 20
    while True:
        stats = engine_stats(url)
        if stats["running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
            break
        assert time.monotonic() < deadline, f"engine still busy after the client left: {stats}"
        time.sleep(0.1)
    assert stats["generated_tokens"] - idle["generated_tokens"] < 16 * 1000  # stopped long before 16 x 2000


def test_unknown_input_port_is_400_naming_it(llm_server):
    body = {"inputs": {"prompt": "hi", "promt": "hi"}, "params": {"llm": {"max_tokens": 2}}}
    for stream in (False, True):
        r = httpx.post(llm_server.url + RUN, json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 400
        err = r.json()["error"]
        assert_openai_error(err, err["code"], param="inputs")
        assert "promt" in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("timeout", [0, -1, -0.5])
def test_timeout_not_positive_is_400(llm_server, timeout):
    body = {"inputs": {"prompt": "hi"}, "params": {"llm": {"max_tokens": 2}}, "timeout": timeout}
    r = httpx.post(llm_server.url + RUN, json=body, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert_openai_error(err, err["code"], param="timeout")
    assert err["type"] == "invalid_request_error"
