"""What routers need from the app: the registry, a ready pipeline by model name, and
cancellation of pipeline work when the HTTP client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

from omnistage.errors import RequestCancelledError
from omnistage.serving.registry import PipelineRegistry

T = TypeVar("T")

DISCONNECT_POLL_S = 0.1


def get_registry(request: Request) -> PipelineRegistry:
    return request.app.state.registry


def get_pipeline(request: Request, model: str) -> Any:
    """The ready Pipeline serving `model`; raises the OpenAI-style 404/503 otherwise."""
    return get_registry(request).get(model)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` (e.g. pipeline.generate(...)), cancelling it if the client disconnects.

    Streaming responses are cancelled by Starlette itself when the client leaves; a plain
    awaited call is not, so a non-streaming route wraps its pipeline call in this. Cancelling
    the task closes the pipeline's stream, which aborts the request in every stage.
    Call it after the body was read (FastAPI has, for a pydantic body).
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001 - client is gone
                    pass
                raise RequestCancelledError("the client disconnected")
    finally:
        if not task.done():  # the route itself was cancelled
            task.cancel()
