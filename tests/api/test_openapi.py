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
