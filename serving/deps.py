"""What routers need from the app: the registry and a ready pipeline by model name."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from omnistage.serving.registry import PipelineRegistry


def get_registry(request: Request) -> PipelineRegistry:
    return request.app.state.registry


def get_pipeline(request: Request, model: str) -> Any:
    """The ready Pipeline serving `model`; raises the OpenAI-style 404/503 otherwise."""
    return get_registry(request).get(model)
