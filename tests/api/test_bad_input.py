"""Bad requests to the OpenAI routes over real HTTP (httpx): each gets its status and error
code in OpenAI's shape, and the server keeps answering good requests."""

from __future__ import annotations

import base64
import io
import wave

import httpx
import pytest

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _wav() -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * 1600)
    return base64.b64encode(buf.getvalue()).decode()


CASES = [
    # (name, path, body or raw bytes, status, code, param)
    ("malformed-json", CHAT, b'{"model": "tiny-llm", "messages": [', 400, "invalid_json", None),
    ("empty-body", CHAT, b"", 400, "missing_body", None),
    ("json-array-body", CHAT, b"[]", 400, "invalid_body", None),
    (
        "wrong-type",
        CHAT,
        {"model": "tiny-llm", "messages": USER, "temperature": "hot"},
        400,
        "invalid_value",
        "temperature",
    ),
    (
        "wrong-role",
        CHAT,
        {"model": "tiny-llm", "messages": [{"role": "robot", "content": "x"}]},
        400,
        "invalid_value",
        "messages[0].role",
    ),
    ("missing-messages", CHAT, {"model": "tiny-llm"}, 400, "invalid_value", "messages"),
    (
        "user-without-content",
        CHAT,
        {"model": "tiny-llm", "messages": [{"role": "user"}]},
        400,
        None,
        "messages[0].content",
    ),
    (
        "unknown-part-type",
        CHAT,
        {"model": "tiny-llm", "messages": [{"role": "user", "content": [{"type": "foo"}]}]},
        400,
        "invalid_value",
        "messages[0].content[0]",
    ),
    ("missing-model", CHAT, {"messages": USER}, 400, "invalid_value", "model"),
    ("unknown-field", CHAT, {"model": "tiny-llm", "messages": USER, "max_token": 3}, 400, "invalid_value", "max_token"),
    ("unknown-model", CHAT, {"model": "gpt-9", "messages": USER}, 404, "model_not_found", "model"),
    ("model-not-serving", CHAT, {"model": "tiny-image", "messages": USER}, 400, "model_not_supported", "model"),
    ("n-too-large", CHAT, {"model": "tiny-llm", "messages": USER, "n": 100}, 400, "invalid_value", "n"),
    (
        "stage-range",
        CHAT,
        {"model": "tiny-llm", "messages": USER, "max_tokens": 2, "min_tokens": 5},
        400,
        None,
        "min_tokens",
    ),
    (
        "bad-base64",
        CHAT,
        {
            "model": "tiny-llm",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "@@not base64@@", "format": "wav"}}],
                }
            ],
        },
        400,
        "invalid_base64",
        "messages[0].content[0].input_audio.data",
    ),
    (
        "audio-not-taken",
        CHAT,
        {
            "model": "tiny-llm",
            "messages": [
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": _wav(), "format": "wav"}}]}
            ],
        },
        400,
        "unsupported_value",
        "messages[0].content[0]",
    ),
    (
        "undecodable-image",
        CHAT,
        {
            "model": "tiny-llm",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()},
                        }
                    ],
                }
            ],
        },
        400,
        "invalid_image",
        "messages[0].content[0].image_url",
    ),
    (
        "unsupported-size",
        "/v1/images/generations",
        {"model": "tiny-image", "prompt": "x", "size": "33x32"},
        400,
        None,
        "size",
    ),
    (
        "bad-size",
        "/v1/images/generations",
        {"model": "tiny-image", "prompt": "x", "size": "big"},
        400,
        "invalid_size",
        "size",
    ),
    (
        "oversized",
        CHAT,
        {"model": "tiny-llm", "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]},
        413,
        "body_too_large",
        None,
    ),
    (
        "completions-list",
        "/v1/completions",
        {"model": "tiny-llm", "prompt": ["a", "b"]},
        400,
        "unsupported_value",
        "prompt",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "code", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_answered_and_the_server_stays_healthy(api_server, path, body, status, code, param):
    url = api_server.url + path
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert " object at 0x" not in err["message"], err  # words for the client, not a Python repr
    if code is not None:
        assert err["code"] == code, err
    assert err["param"] == param, err
    good = httpx.post(api_server.url + CHAT, json={"model": "tiny-llm", "messages": USER, "max_tokens": 2}, timeout=60)
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["role"] == "assistant"


def test_a_json_body_without_its_content_type_is_told_to_send_one(api_server):
    body = b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}]}'
    r = httpx.post(api_server.url + CHAT, content=body, headers={"content-type": "text/plain"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_body" and "Content-Type: application/json" in err["message"], err


def test_explicit_nulls_mean_the_defaults(api_server):
    """OpenAI's reference marks these optional fields nullable, and clients send them so."""
    nulls = {"n": None, "stream": None, "logprobs": None, "temperature": None, "stop": None}
    r = httpx.post(
        api_server.url + CHAT, json={"model": "tiny-llm", "messages": USER, "max_tokens": 2, **nulls}, timeout=60
    )
    assert r.status_code == 200, r.text
    reply = r.json()
    assert len(reply["choices"]) == 1 and reply["choices"][0]["logprobs"] is None
    r = httpx.post(
        api_server.url + "/v1/completions",
        json={"model": "tiny-llm", "prompt": "a", "max_tokens": 2, "n": None, "echo": None, "stream": None},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = httpx.post(
        api_server.url + "/v1/images/generations",
        json={"model": "tiny-image", "prompt": "x", "size": "64x64", "n": None, "response_format": None},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.json()["data"]) == 1 and r.json()["data"][0]["b64_json"], r.text[:300]
    refused = httpx.post(api_server.url + CHAT, json={"model": None, "messages": USER}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
