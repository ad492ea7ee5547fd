"""API keys against a live `omnistage serve --api-key ... --max-concurrent-per-key 1`: 401 in
OpenAI's shape on every route without the right key (the official client raises
AuthenticationError), the probes stay open, and a key's second request in flight gets 429
with Retry-After while another key is served."""

from __future__ import annotations

import httpx
import openai
import pytest

from omnistage.tests.api.conftest import live_server

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    args = ["tiny-llm", "--api-key", KEYS[0], "--max-concurrent-per-key", "1"]
    with live_server(tmp_path_factory, args, env={"OMNISTAGE_API_KEYS": KEYS[1]}) as server:
        yield server


def _client(server, key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/metrics"),
        ("POST", "/v1/pipelines/tiny-llm/run"),
        ("GET", "/openapi.json"),
    ],
)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEYS[0]}"])
def test_every_route_wants_a_key(keyed_server, method, path, auth):
    headers = {"Authorization": auth} if auth else {}
    r = httpx.request(method, keyed_server.url + path, headers=headers, json={}, timeout=30)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"


def test_probes_are_open_and_both_keys_work(keyed_server):
    assert httpx.get(keyed_server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(keyed_server.url + "/ready", timeout=10).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        _client(keyed_server, "nope").models.list()
    for key in KEYS:  # one from --api-key, one from OMNISTAGE_API_KEYS
        reply = _client(keyed_server, key).chat.completions.create(
            model="tiny-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.choices[0].message.role == "assistant"


def test_a_keys_second_request_in_flight_is_429(keyed_server):
    one = _client(keyed_server, KEYS[0])
    body = dict(
        model="tiny-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=400, extra_body={"ignore_eos": True}
    )
    stream = one.chat.completions.create(**body, stream=True)
    next(iter(stream))  # the stream is open: key one has a request in flight
    try:
        r = httpx.get(keyed_server.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=10)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert r.json()["error"]["type"] == "rate_limit_error"
        other = httpx.get(keyed_server.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[1]}"}, timeout=10)
        assert other.status_code == 200
    finally:
        stream.close()
    for _ in range(50):  # the closed stream's slot is released once the server notices
        r = httpx.get(keyed_server.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=10)
        if r.status_code == 200:
            break
        import time

        time.sleep(0.1)
    assert r.status_code == 200
