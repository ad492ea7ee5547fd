"""GET /openapi.json documents the OpenAI routes with their pydantic request/response schemas."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.parametrize(
    ("path", "request_model", "response_model"),
    [
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletion"),
        ("/v1/completions", "CompletionRequest", "Completion"),
        ("/v1/images/generations", "ImageGenerationRequest", "ImagesResponse"),
    ],
)
def test_routes_carry_their_schemas(api_server, path, request_model, response_model):
    spec = httpx.get(api_server.url + "/openapi.json", timeout=30).json()
    post = spec["paths"][path]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request_model)
    ok = post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert ok.endswith("/" + response_model)
    schemas = spec["components"]["schemas"]
    assert "model" in schemas[request_model]["properties"]
    assert schemas[response_model]["properties"]


def test_edits_and_speech_carry_their_schemas(api_server):
    spec = httpx.get(api_server.url + "/openapi.json", timeout=30).json()
    schemas = spec["components"]["schemas"]
    edits = spec["paths"]["/v1/images/edits"]["post"]
    form = edits["requestBody"]["content"]["multipart/form-data"]["schema"]["$ref"].split("/")[-1]
    assert {"image", "prompt", "strength", "mask"} <= set(schemas[form]["properties"])
    assert edits["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ImagesResponse")
    assert "text/event-stream" in edits["responses"]["200"]["content"]
    speech = spec["paths"]["/v1/audio/speech"]["post"]
    assert speech["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/SpeechRequest")
    assert {"audio/mpeg", "audio/wav", "audio/pcm", "text/event-stream"} <= set(speech["responses"]["200"]["content"])
    assert {"input", "voice", "response_format", "speed", "stream_format"} <= set(
        schemas["SpeechRequest"]["properties"]
    )


def test_every_operation_id_is_unique(api_server):
    """Client generators key methods by operationId; a route answering two methods under one
    function (GET and HEAD) must not publish the id twice."""
    spec = httpx.get(api_server.url + "/openapi.json", timeout=30).json()
    ids = [op["operationId"] for item in spec["paths"].values() for op in item.values() if "operationId" in op]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
