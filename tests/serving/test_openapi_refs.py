"""Every `$ref` in /openapi.json resolves inside the document, judged by the `referencing`
library (what jsonschema uses), so client generators and fuzzers can load the schema."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi.testclient import TestClient
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from omnistage.serving.app import create_app
from omnistage.serving.registry import PipelineRegistry


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_every_reference_in_the_openapi_document_resolves():
    app = create_app(PipelineRegistry(), load_on_startup=False)
    with TestClient(app) as client:
        doc = client.get("/openapi.json").json()
    refs = sorted(set(_refs(doc)))
    assert any(r.startswith("#/components/schemas/") for r in refs)
    resolver = Registry().with_resource("urn:openapi", Resource(doc, DRAFT202012)).resolver("urn:openapi")
    unresolved = []
    for ref in refs:
        try:
            resolver.lookup(ref)
        except Exception:  # the library raises its own Unresolvable subclasses
            unresolved.append(ref)
    assert not unresolved, f"dangling $ref in /openapi.json: {unresolved}"


def test_streamed_chat_schema_describes_the_chunk_fields():
    app = create_app(PipelineRegistry(), load_on_startup=False)
    with TestClient(app) as client:
        doc = client.get("/openapi.json").json()
    stream = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    choice = stream["schema"]["properties"]["choices"]["items"]
    assert "delta" in choice["properties"]
