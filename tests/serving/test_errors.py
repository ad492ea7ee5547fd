"""Error bodies of the app itself (no pipelines): FastAPI validation and omnistage errors as
OpenAI-style JSON, through a real FastAPI app and HTTP client (Starlette's TestClient)."""

from typing import Literal

from fastapi import APIRouter
from fastapi.testclient import TestClient
from pydantic import BaseModel

from omnistage.errors import DeadlineExceededError, InvalidRequestError, OverloadedError, StageError, WorkerDiedError
from omnistage.serving.app import create_app
from omnistage.serving.registry import PipelineRegistry


class Message(BaseModel):
    role: str
    content: str


class ChatBody(BaseModel):
    model: str
    messages: list[Message]
    voice: str | Literal[1, 2] | None = None
    stop: str | list[str] | None = None


def _app():
    router = APIRouter()

    @router.post("/v1/test/chat")
    async def chat(body: ChatBody):
        return {"ok": True}

    errors = {
        "invalid": InvalidRequestError("temperature must be >= 0", param="temperature"),
        "overloaded": OverloadedError("intake queue full"),
        "deadline": DeadlineExceededError("too slow"),
        "stage": StageError("llm", "boom"),
        "died": WorkerDiedError("vae", "killed"),
        "bug": RuntimeError("unexpected"),
    }

    @router.get("/v1/test/raise/{which}")
    async def raise_(which: str):
        raise errors[which]

    return create_app(PipelineRegistry(), routers=[router])


def test_nested_validation_error_names_the_field():
    with TestClient(_app()) as client:
        r = client.post("/v1/test/chat", json={"model": "m", "messages": [{"role": "user"}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "messages[0].content"


def test_a_union_fields_error_names_the_field_not_the_member_type():
    """pydantic locates an error in `voice: str | Literal[...]` at ("body", "voice", "str");
    of a union's members, the one that got furthest into the value is the one reported."""
    with TestClient(_app()) as client:
        for body, param in (({"voice": 5.5}, "voice"), ({"stop": ["a", 3]}, "stop[1]")):
            r = client.post("/v1/test/chat", json={"model": "m", "messages": [], **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_omnistage_errors_map_by_status_and_code():
    expected = {
        "invalid": (400, "invalid_request_error", "invalid_value"),
        "overloaded": (503, "server_error", "overloaded"),
        "deadline": (504, "server_error", "deadline_exceeded"),
        "stage": (500, "server_error", "stage_error"),
        "died": (503, "server_error", "worker_died"),
        "bug": (500, "server_error", "internal_error"),
    }
    with TestClient(_app(), raise_server_exceptions=False) as client:
        for which, (status, type_, code) in expected.items():
            r = client.get(f"/v1/test/raise/{which}")
            assert r.status_code == status, (which, r.text)
            err = r.json()["error"]
            assert (err["type"], err["code"]) == (type_, code), which
        assert client.get("/v1/test/raise/invalid").json()["error"]["param"] == "temperature"
        assert client.get("/v1/test/raise/overloaded").headers["retry-after"] == "1"
        # no pipelines configured: not ready, but alive
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 503
