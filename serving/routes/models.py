"""/v1/models in the OpenAI list format: one model per hosted pipeline, with the API families
it serves (its YAML's `serves:`, and `videos` for what /v1/videos takes) and their
input/output modalities."""

from __future__ import annotations

from fastapi import APIRouter, Request

from omnistage.serving.errors import ModelNotFoundError
from omnistage.serving.routes.videos import video_port

router = APIRouter(tags=["models"])


def _model_card(entry) -> dict:
    spec = entry.effective_spec
    serves = getattr(spec, "serves", None) or {}
    modalities = {family: s.modalities for family, s in serves.items()}
    if video_port(spec) is not None:  # /v1/videos needs no `serves:` entry
        modalities["videos"] = {"input": ["text"], "output": ["video"]}
    return {
        "id": entry.name,
        "object": "model",
        "created": entry.created,
        "owned_by": "omnistage",
        "ready": entry.is_ready(),
        "serves": list(modalities),
        "modalities": modalities,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    registry = request.app.state.registry
    return {"object": "list", "data": [_model_card(e) for e in registry.entries()]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict:
    registry = request.app.state.registry
    model = model.rstrip("/")  # a path parameter (names may hold slashes): /v1/models/NAME/ is NAME
    if not model:
        return await list_models(request)
    entry = registry.entry(model)
    if entry is None:
        raise ModelNotFoundError(model, registry.names())
    return _model_card(entry)
