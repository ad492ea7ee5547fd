"""Errors a client can act on, against a live `omnistage serve` over real HTTP (httpx):
refusals before any output keep their status when streaming, a stage's `param` reaches the
JSON error, body-parser failures have codes, bodies above the limit get 413, and a server
bound to loopback answers only loopback Host names (DNS rebinding)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from openai._streaming import SSEDecoder

from omnistage.tests.serving.conftest import start_server

RUN = "/v1/pipelines/tiny-llm/run"


def _error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code, err
    return err


@pytest.mark.parametrize("stream", [False, True])
def test_bad_param_is_400_naming_the_param_streamed_or_not(tiny_server, stream):
    body = {"inputs": {"prompt": "hi"}, "params": {"llm": {"max_tokens": -4}}, "stream": stream}
    r = httpx.post(tiny_server.url + RUN, json=body, timeout=60)
    err = _error(r, 400, "invalid_value")
    assert err["param"] == "max_tokens"
    assert "max_tokens" in err["message"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (RUN, {"inputs": {"prompt": "hi"}, "param": {"llm": {"max_tokens": 2}}}, "param"),
        (RUN, {"inputs": {"prompt": "hi"}, "strem": True}, "strem"),
        ("/v1/jobs", {"model": "tiny-llm", "inputs": {"prompt": "hi"}, "parms": {}}, "parms"),
        (
            "/v1/jobs",
            {"model": "tiny-llm", "inputs": {"prompt": "hi"}, "webhook": {"url": "http://x", "event": []}},
            "webhook.event",
        ),
    ],
)
def test_a_misspelt_body_field_is_400_naming_it(tiny_server, path, body, field):
    """Not ignored: a misspelt `params` would have run with the defaults."""
    err = _error(httpx.post(tiny_server.url + path, json=body, timeout=60), 400, "invalid_value")
    assert err["param"] == field, err


def test_stream_that_starts_is_sse_and_ends_with_done(tiny_server):
    body = {"inputs": {"prompt": "hi"}, "params": {"llm": {"max_tokens": 3, "ignore_eos": True}}, "stream": True}
    with httpx.stream("POST", tiny_server.url + RUN, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e.data for e in SSEDecoder().iter_bytes(r.iter_bytes())]  # the openai client's decoder
    assert events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for t in (json.loads(e)["data"] if json.loads(e)["port"] == "tokens" else [])]
    assert len(tokens) == 3


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"\xff\xfe{", "JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"inputs": ', "JSON"),
    ],
    ids=["not-utf8", "deep-nesting", "truncated"],
)
def test_unparseable_bodies_have_a_code(tiny_server, payload, needle):
    r = httpx.post(tiny_server.url + RUN, content=payload, headers={"content-type": "application/json"}, timeout=30)
    err = _error(r, 400, "invalid_json")
    assert needle in err["message"]


def test_body_over_the_limit_is_413_before_it_is_read(tiny_server):
    big = json.dumps({"inputs": {"prompt": "x" * (5 * 1024 * 1024)}}).encode()
    r = httpx.post(tiny_server.url + RUN, content=big, headers={"content-type": "application/json"}, timeout=30)
    err = _error(r, 413, "body_too_large")
    assert "4194304" in err["message"]


def test_chunked_body_over_the_limit_is_413(tiny_server):
    def chunks():  # no Content-Length: httpx sends it chunked
        yield b'{"inputs": {"prompt": "'
        for _ in range(6):
            yield b"x" * (1024 * 1024)
        yield b'"}}'

    r = httpx.post(tiny_server.url + RUN, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    _error(r, 413, "body_too_large")
    # the server is unharmed
    ok = httpx.post(tiny_server.url + RUN, json={"inputs": {"prompt": "hi"}, "params": {"llm": {"max_tokens": 2}}})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:8000", "192.168.1.5", "127.0.0.1.nip.io"])
def test_foreign_host_header_is_refused_on_loopback(tiny_server, host):
    r = httpx.get(tiny_server.url + "/v1/models", headers={"host": host}, timeout=10)
    err = _error(r, 421, "host_not_allowed")
    assert err["param"] == "Host"


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1", "[::1]:9", "app.localhost"])
def test_loopback_host_headers_are_answered(tiny_server, host):
    assert httpx.get(tiny_server.url + "/v1/models", headers={"host": host}, timeout=10).status_code == 200


def test_allowed_host_flag_and_body_limit_flag(tmp_path):
    server = start_server(
        [
            "tiny-llm",
            "--allowed-host",
            "api.example.com:443",  # the port is ignored
            "--max-body-bytes",
            "1000",
        ],
        tmp_path / "server.log",
    )
    try:
        server.wait_ready(timeout=300)
        for host in ("api.example.com", "API.example.com:8000"):
            assert httpx.get(server.url + "/v1/models", headers={"host": host}).status_code == 200
        _error(httpx.get(server.url + "/v1/models", headers={"host": "other.example.com"}), 421, "host_not_allowed")
        body = {"inputs": {"prompt": "x" * 2000}}
        _error(httpx.post(server.url + RUN, json=body), 413, "body_too_large")
    finally:
        server.stop()


def test_non_loopback_bind_warns_that_there_is_no_authentication(tmp_path):
    server = start_server(["tiny-llm", "--host", "0.0.0.0"], tmp_path / "server.log")
    try:
        server.wait_ready(timeout=300)
        # bound to every address, the server answers other Host names (no policy to apply)
        assert httpx.get(server.url + "/v1/models", headers={"host": "box.lan"}).status_code == 200
    finally:
        server.stop()
    log = server.log()
    assert "not a loopback address" in log and "no authentication" in log, log
    assert f"serving tiny-llm on http://0.0.0.0:{server.port}" in log, log


def test_a_taken_port_is_an_error_and_never_announced_as_served(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = start_server(["tiny-llm"], tmp_path / "server.log", port=taken.getsockname()[1])
        try:
            assert server.proc.wait(120) != 0
        finally:
            server.stop()
    log = server.log()
    assert "address already in use" in log.lower(), log
    assert "serving tiny-llm on" not in log, log


def test_docs_page_loads_its_assets_from_this_server(tiny_server):
    page = httpx.get(tiny_server.url + "/docs", timeout=10)
    assert page.status_code == 200
    assert "cdn.jsdelivr.net" not in page.text and "unpkg.com" not in page.text
    for asset in ("/docs-assets/swagger-ui-bundle.js", "/docs-assets/swagger-ui.css"):
        assert asset in page.text
        r = httpx.get(tiny_server.url + asset, timeout=10)
        assert r.status_code == 200 and len(r.content) > 10_000
    spec = httpx.get(tiny_server.url + "/openapi.json", timeout=10).json()
    assert "/v1/pipelines/{name}/run" in spec["paths"]


def test_official_openai_client_reads_stage_errors_with_their_param(tiny_server):
    import openai

    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused", max_retries=0)
    body = {"inputs": {"prompt": "hi"}, "params": {"llm": {"temperature": -1}}, "stream": True}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/pipelines/tiny-llm/run", body=body, cast_to=object)
    assert info.value.status_code == 400
    assert info.value.param == "temperature" and info.value.code == "invalid_value"
    with pytest.raises(openai.NotFoundError) as info:
        client.post("/pipelines/nope/run", body={"inputs": {}}, cast_to=object)
    assert info.value.code == "model_not_found" and info.value.param == "model"
