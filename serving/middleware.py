"""ASGI middleware: in-flight accounting for drain, 503 while draining, request metrics.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and websockets pass through
untouched and a request counts as in flight until its last body byte is sent.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from omnistage.serving.errors import error_body
from omnistage.streaming.sse import SSE_DONE, sse_event

# Probes and scrapes: never counted as work, always answered (also while draining).
SYSTEM_PATHS = frozenset({"/health", "/ready", "/metrics", "/v1/models", "/v1/pipelines"})


def is_system_path(path: str, method: str) -> bool:
    """Probes, scrapes and read-only listings (models, pipeline cards): not work."""
    if path in SYSTEM_PATHS or path.startswith("/v1/models/"):
        return True
    return method == "GET" and path.startswith("/v1/pipelines/") and path.count("/") == 3


class ServingMiddleware:
    def __init__(self, app, registry: Any, metrics: Any):
        self.app = app
        self.registry = registry
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        system = is_system_path(path, scope.get("method", "GET"))
        if self.registry.draining and not system:
            await _reject_draining(kind, send)
            self.metrics.observe(scope.get("method", "WS"), "draining", 503, 0.0)
            return
        # Label: the HTTP status; for websockets 101 once accepted, 403 if closed before that.
        status = {"code": 500, "started": False, "ended": False, "sse": False}

        async def send_wrapper(message):
            kind_ = message["type"]
            if kind_ == "http.response.start":
                status["code"] = message["status"]
                status["started"] = True
                status["sse"] = any(
                    k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"]
                )
            elif kind_ == "http.response.body" and not message.get("more_body", False):
                status["ended"] = True
            elif kind_ == "websocket.accept":
                status["code"] = 101
            elif kind_ == "websocket.close" and status["code"] == 500:
                status["code"] = 403
            await send(message)

        start = time.perf_counter()
        task = asyncio.current_task()
        if not system:
            self.registry.inflight += 1
            self.registry.work_tasks.add(task)
        try:
            await self.app(scope, receive, send_wrapper)
        except asyncio.CancelledError:
            # cut by the drain timeout (registry.cut_inflight): answer instead of dropping it
            if not (self.registry.cutting and task.uncancel() == 0 and kind == "http"):
                raise
            await _answer_cut_request(status, send)
        finally:
            if not system:
                self.registry.inflight -= 1
                self.registry.work_tasks.discard(task)
            route = scope.get("route")
            route_path = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "WS")
            self.metrics.observe(method, route_path, status["code"], time.perf_counter() - start)


DRAIN_CUT_MESSAGE = "The server shut down before this request finished (drain timeout); retry on another replica."


async def _answer_cut_request(status: dict, send) -> None:
    """A 503 `draining` for a request the drain timeout cut; a started stream is ended (an SSE
    stream with the error as its last event), so the client sees why instead of a reset."""
    import json

    if status["ended"]:
        return
    if not status["started"]:
        body = json.dumps(error_body(DRAIN_CUT_MESSAGE, status=503, code="draining")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 503, "headers": [*headers, (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})
        return
    tail = b""
    if status["sse"]:
        tail = sse_event(error_body(DRAIN_CUT_MESSAGE, status=503, code="draining")) + SSE_DONE
    await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _reject_draining(kind: str, send) -> None:
    if kind == "websocket":
        # 1013 "try again later": the client should reconnect elsewhere.
        await send({"type": "websocket.close", "code": 1013, "reason": "server draining"})
        return
    import json

    body = json.dumps(
        error_body("The server is shutting down; retry on another replica.", status=503, code="draining")
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", b"1"),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
