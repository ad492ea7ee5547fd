"""`omnistage serve` as a real subprocess, probed with a real HTTP client.

One server (tests/serving/slow-scale.yaml; its first stage sleeps 0.2 s per call, or what a
request asks for) serves the module; the drain test comes late because it ends the process.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import torch
from openai._streaming import SSEDecoder
from prometheus_client.parser import text_string_to_metric_families

from omnistage.tests.serving.conftest import alive, cmdline, descendants, shm_segments_of, start_server
from omnistage.tests.serving.slow_module import SlowScale

MODEL = "slow-scale"
SLOW = {"params": {"slow": {"delay_s": 2.0}}}  # holds a request in the slow stage


def _reference(x: list[float]) -> list[float]:
    # The same two modules the workers build, run here in one process.
    with torch.inference_mode():
        return SlowScale(3.0)(SlowScale(2.0)(torch.tensor(x))).tolist()


def _assert_openai_error(response: httpx.Response, status: int, code: str | None = None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def test_health_answers_while_pipelines_load(slow_server):
    probes = slow_server.probes
    assert probes, "no probe answered"
    # The slow stage takes 2 s to build: liveness answered 200 while readiness was 503.
    assert any(h == 200 and r == 503 for _, h, r in probes), probes[:5]
    assert probes[-1][1:] == (200, 200)
    ready = httpx.get(f"{slow_server.url}/ready").json()
    assert ready["ready"] is True and ready["draining"] is False
    stages = ready["pipelines"][MODEL]["stages"]
    assert set(stages) == {"slow", "add"} and all(s["ready"] for s in stages.values())
    for probe in ("/health", "/ready"):  # HEAD as some load balancers probe: the status, no body
        head = httpx.head(f"{slow_server.url}{probe}")
        assert head.status_code == 200 and head.content == b"", probe


def test_models_list_in_openai_format(slow_server):
    body = httpx.get(f"{slow_server.url}/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "omnistage"
    assert isinstance(card["created"], int) and card["created"] > 1_600_000_000
    assert httpx.get(f"{slow_server.url}/v1/models/{MODEL}").json()["id"] == MODEL
    # trailing slashes: the model's card and the list, not "model 'NAME/' does not exist"
    assert httpx.get(f"{slow_server.url}/v1/models/{MODEL}/").json()["id"] == MODEL
    assert httpx.get(f"{slow_server.url}/v1/models/").json() == body


def test_official_openai_client_reads_models_and_errors(slow_server):
    import openai

    client = openai.OpenAI(base_url=f"{slow_server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "omnistage"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_run_matches_in_process_reference(slow_server):
    x = [0.5, -1.0, 3.25]
    r = httpx.post(f"{slow_server.url}/v1/pipelines/{MODEL}/run", json={"inputs": {"x": x}}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"]["y"] == pytest.approx(_reference(x))


def test_streamed_run_is_sse(slow_server):
    x = [1.0, 2.0]
    with httpx.stream(
        "POST", f"{slow_server.url}/v1/pipelines/{MODEL}/run", json={"inputs": {"x": x}, "stream": True}, timeout=30
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(SSEDecoder().iter_bytes(r.iter_bytes()))
    assert events[-1].data == "[DONE]"
    chunks = [json.loads(e.data) for e in events[:-1]]
    data = [c for c in chunks if c["port"] == "y"]
    assert data and data[-1]["final"] is True
    assert [v for c in data for v in c["data"]] == pytest.approx(_reference(x))


def test_errors_are_openai_json(slow_server):
    url = slow_server.url
    err = _assert_openai_error(httpx.get(f"{url}/no/such/route"), 404, "not_found")
    assert err["type"] == "invalid_request_error"
    err = _assert_openai_error(
        httpx.post(f"{url}/v1/pipelines/nope/run", json={"inputs": {"x": [1.0]}}), 404, "model_not_found"
    )
    assert err["param"] == "model" and MODEL in err["message"]
    err = _assert_openai_error(httpx.post(f"{url}/v1/pipelines/{MODEL}/run", json={"x": 1}), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == "inputs"
    _assert_openai_error(
        httpx.post(
            f"{url}/v1/pipelines/{MODEL}/run", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
    )
    err = _assert_openai_error(httpx.post(f"{url}/v1/pipelines/{MODEL}/run", json={"inputs": {"x": "abc"}}), 400)
    assert err["param"] == "inputs.x"
    _assert_openai_error(httpx.delete(f"{url}/v1/models"), 405)


def test_stage_failures_map_to_http_statuses(slow_server):
    url = f"{slow_server.url}/v1/pipelines/{MODEL}/run"
    err = _assert_openai_error(httpx.post(url, json={"inputs": {"x": [-5000.0]}}, timeout=30), 400)
    assert err["type"] == "invalid_request_error" and ">=" in err["message"]
    assert err["param"] == "x"  # raised in the worker, carried through to the HTTP error
    err = _assert_openai_error(httpx.post(url, json={"inputs": {"x": [5e6]}}, timeout=30), 500, "stage_error")
    assert err["type"] == "server_error" and "slow" in err["message"]
    _assert_openai_error(
        httpx.post(
            url, json={"inputs": {"x": [1.0]}, "timeout": 0.3, "params": {"slow": {"delay_s": 1.5}}}, timeout=30
        ),
        504,
        "deadline_exceeded",
    )


def test_full_intake_queue_rejects_at_once(slow_server):
    url = f"{slow_server.url}/v1/pipelines/{MODEL}/run"
    statuses: list[int] = []

    def call():
        statuses.append(httpx.post(url, json={"inputs": {"x": [1.0]}, **SLOW}, timeout=30).status_code)

    # max_queued_requests is 2 and each request holds the slow stage for 2 s.
    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if "omnistage_http_inflight_requests 2.0" in httpx.get(f"{slow_server.url}/metrics").text:
            break
        time.sleep(0.02)
    rejected = None
    for _ in range(5):  # a probe sent before both were admitted would queue: try again
        start = time.monotonic()
        response = httpx.post(url, json={"inputs": {"x": [1.0]}}, timeout=30)
        if response.status_code == 503:
            rejected = response
            assert time.monotonic() - start < 1.0, "a full queue must reject without waiting"
            break
    assert rejected is not None, "the full intake queue never rejected"
    err = _assert_openai_error(rejected, 503, "overloaded")
    assert rejected.headers["retry-after"] == "1" and err["type"] == "server_error"
    # streamed, the refusal comes before any output: the same 503, not a 200 stream
    streamed = httpx.post(url, json={"inputs": {"x": [1.0]}, "stream": True}, timeout=30)
    _assert_openai_error(streamed, 503, "overloaded")
    for t in threads:
        t.join(30)
    assert statuses == [200, 200]


def test_metrics_parse_as_prometheus_text(slow_server):
    text = httpx.get(f"{slow_server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = families["omnistage_http_requests"]
    runs = [
        s
        for s in requests.samples
        if s.name == "omnistage_http_requests_total"
        and s.labels["route"] == "/v1/pipelines/{name}/run"
        and s.labels["status"] == "200"
    ]
    assert runs and sum(s.value for s in runs) >= 2  # the runs above
    unmatched = [
        s
        for s in requests.samples
        if s.name == "omnistage_http_requests_total"
        and s.labels["route"] == "unmatched"
        and s.labels["status"] == "404"
    ]
    assert unmatched, "the unknown route above is counted under a bounded label"
    assert families["omnistage_ready"].samples[0].value == 1.0
    # The runtime's per-stage series, labelled with this pipeline and both its stages.
    for family in (
        "omnistage_stage_queue_depth",
        "omnistage_stage_batch_size",
        "omnistage_stage_step_seconds",
        "omnistage_stage_inflight_requests",
    ):
        stages = {s.labels["stage"] for s in families[family].samples if s.labels.get("pipeline") == MODEL}
        assert stages == {"slow", "add"}, (family, stages)
    steps = [
        s
        for s in families["omnistage_stage_step_seconds"].samples
        if s.name == "omnistage_stage_step_seconds_count" and s.labels["stage"] == "slow"
    ]
    assert steps and steps[0].value >= 2  # the slow stage ran the requests above


def _pipeline_outcome(url: str, outcome: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text)
    return sum(
        s.value
        for f in families
        for s in f.samples
        if s.name == "omnistage_pipeline_requests_total"
        and s.labels.get("pipeline") == MODEL
        and s.labels.get("outcome") == outcome
    )


def test_client_disconnect_cancels_the_pipeline_request(slow_server):
    url = slow_server.url
    before = _pipeline_outcome(url, "cancelled")
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the slow stage runs
        httpx.post(f"{url}/v1/pipelines/{MODEL}/run", json={"inputs": {"x": [1.0]}, **SLOW}, timeout=0.5)
    deadline = time.monotonic() + 10
    while _pipeline_outcome(url, "cancelled") <= before:
        assert time.monotonic() < deadline, "the abandoned request was never cancelled"
        time.sleep(0.05)


def test_sigterm_drains_inflight_then_exits_clean(slow_server):
    url, proc = slow_server.url, slow_server.proc
    children = descendants(proc.pid)
    assert children, "the stage workers should be child processes"
    cmdlines = {pid: cmdline(pid) for pid in children}
    result: dict = {}

    def slow_request():
        try:
            r = httpx.post(
                f"{url}/v1/pipelines/{MODEL}/run",
                json={"inputs": {"x": [4.0]}, "params": {"slow": {"delay_s": 4.0}}},
                timeout=60,
            )
            result["status"], result["body"] = r.status_code, r.json()
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            result["error"] = repr(exc)

    worker = threading.Thread(target=slow_request)
    worker.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # wait until the server counts the request in flight
        text = httpx.get(f"{url}/metrics").text
        if "omnistage_http_inflight_requests 1.0" in text:
            break
        time.sleep(0.02)
    else:
        pytest.fail("request never went in flight")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)

    # New work is refused while the in-flight request finishes; probes still answer.
    refused = None
    while worker.is_alive() and time.monotonic() - sent < 10:
        try:
            refused = httpx.post(f"{url}/v1/pipelines/{MODEL}/run", json={"inputs": {"x": [1.0]}}, timeout=5)
            break
        except httpx.TransportError:
            time.sleep(0.02)
    assert refused is not None, "the server stopped listening before in-flight work finished"
    _assert_openai_error(refused, 503, "draining")
    metrics = httpx.get(f"{url}/metrics").text  # probes still answer while draining
    assert 'route="draining",status="503"' in metrics and "omnistage_draining 1.0" in metrics
    assert httpx.get(f"{url}/ready").json()["draining"] is True
    assert httpx.get(f"{url}/health").json()["status"] == "draining"
    assert httpx.get(f"{url}/v1/pipelines/{MODEL}").json()["id"] == MODEL  # listings too

    worker.join(60)
    assert result.get("status") == 200, result
    assert result["body"]["outputs"]["y"] == pytest.approx(_reference([4.0]))
    assert proc.wait(30) == 0, slow_server.log()
    # multiprocessing's helpers (forkserver, resource tracker) exit when they see the
    # server's end of their pipe close: give them a moment.
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = {pid: cmdlines.get(pid) for pid in children if alive(pid)}
    assert not leftover, f"processes left behind: {leftover}"
    assert not shm_segments_of(children | {proc.pid})


def test_invalid_config_exits_2_before_serving(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\noutputs: {y: tensor}\nstages:\n  a: {kind: nosuchkind}\nedges: []\n")
    server = start_server([str(bad)], tmp_path / "bad.log")
    assert server.proc.wait(60) == 2
    assert f"{bad}:4:" in server.log()
