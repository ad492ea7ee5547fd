"""Hostile bodies against a live `omnistage serve tiny-llm tiny-omni tiny-image`: each is
refused with a clear OpenAI-style 4xx before it costs memory, and the server stays healthy.

"Before it costs memory" is judged on the server's own processes: the peak resident memory
(VmHWM) of every process of the server grows by less than a small fraction of what the
refused input would decode to (a 10,000 x 10,000 image is 300 MB of RGB; a one-second
1 Hz file resampled to 16 kHz is 16,000x its samples)."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from omnistage.tests.api.conftest import live_server
from omnistage.tests.reliability.media_bombs import flac_silence, peak_rss, png_declaring, wav, webp_declaring

MB = 1 << 20
PEAK_GROWTH_LIMIT = 64 * MB  # the smallest refused input below decodes to ~300 MB


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory, ["tiny-llm", "tiny-omni", "tiny-image"]) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _chat_with(part: dict) -> dict:
    content = [{"type": "text", "text": "what is this?"}, part]
    return {"model": "tiny-omni", "messages": [{"role": "user", "content": content}], "max_tokens": 1}


def _image(data: bytes, kind: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/{kind};base64,{base64.b64encode(data).decode()}"}}


def _audio(data: bytes, fmt: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def _refused(response: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error", error
    assert error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


def test_oversized_and_deeply_nested_json_are_400s(http):
    big = b'{"model": "tiny-llm", "prompt": "' + b"a" * (5 * MB) + b'"}'
    _refused(
        http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413, "body_too_large"
    )
    nested = '{"model": "tiny-llm", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    response = http.post("/v1/chat/completions", content=nested, headers={"content-type": "application/json"})
    assert "nested" in _refused(response, 400, "invalid_json")["message"]
    nested_objects = '{"a":' * 50_000 + "1" + "}" * 50_000
    _refused(
        http.post("/v1/completions", content=nested_objects, headers={"content-type": "application/json"}),
        400,
        "invalid_json",
    )


def test_prompts_past_the_context_are_400s_naming_the_context(http):
    long = "hello " * 5000  # ~5,000 tokens; tiny-llm's context is 2,048
    response = http.post("/v1/completions", json={"model": "tiny-llm", "prompt": long, "max_tokens": 2})
    assert "context" in _refused(response, 400, "context_length_exceeded", "prompt")["message"]
    messages = [{"role": "user", "content": long}]
    response = http.post("/v1/chat/completions", json={"model": "tiny-llm", "messages": messages, "max_tokens": 2})
    # named by the request's field, as OpenAI does, not by the stage's own `prompt`
    assert "context" in _refused(response, 400, "context_length_exceeded", "messages")["message"]
    response = http.post(
        "/v1/chat/completions", json={"model": "tiny-llm", "messages": messages, "max_tokens": 2, "stream": True}
    )
    assert "context" in _refused(response, 400, "context_length_exceeded", "messages")["message"]
    response = http.post("/v1/chat/completions", json={"model": "tiny-omni", "messages": messages, "max_tokens": 2})
    assert "context" in _refused(response, 400, "context_length_exceeded", "messages")["message"]


def test_decompression_bombs_and_absurd_audio_are_refused_before_they_cost_memory(server, http):
    # warm up the decoders every refused input below would reach, so their imports are not counted
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(buf, "PNG")
    small = _image(buf.getvalue(), "png")
    assert http.post("/v1/chat/completions", json=_chat_with(small)).status_code == 200
    assert http.post("/v1/chat/completions", json=_chat_with(_audio(wav(16000, 1600), "wav"))).status_code == 200
    before = peak_rss(server.proc.pid)
    image_param = "messages[0].content[1].image_url"
    audio_param = "messages[0].content[1].input_audio.data"
    cases = [
        (_image(png_declaring(50_000, 50_000), "png"), "image_too_large", image_param),
        (_image(png_declaring(10_000, 10_000), "png"), "image_too_large", image_param),
        (_image(webp_declaring(10_000, 10_000), "webp"), "image_too_large", image_param),
        (_audio(wav(1, 16_000), "wav"), "invalid_sample_rate", audio_param),
        (_audio(wav(10_000_000, 16_000), "wav"), "invalid_sample_rate", audio_param),
        (_audio(flac_silence(4000, 21 * 60), "flac"), "audio_too_long", audio_param),
    ]
    for part, code, param in cases:
        body = _chat_with(part)
        assert len(httpx.Request("POST", "/", json=body).content) < 1 * MB  # inside the body limit
        _refused(http.post("/v1/chat/completions", json=body), 400, code, param)
    upload = {"image": ("bomb.webp", webp_declaring(10_000, 10_000), "image/webp")}
    response = http.post("/v1/images/edits", data={"model": "tiny-image", "prompt": "a cat"}, files=upload)
    _refused(response, 400, "image_too_large", "image")
    after = peak_rss(server.proc.pid)
    growth = {pid: after[pid] - before[pid] for pid in before if pid in after}
    assert max(growth.values()) < PEAK_GROWTH_LIMIT, {pid: g // MB for pid, g in growth.items()}
    assert http.get("/health").status_code == 200
    assert http.post("/v1/chat/completions", json=_chat_with(small)).status_code == 200
