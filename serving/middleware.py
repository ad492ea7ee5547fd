"""ASGI middleware: in-flight accounting for drain, 503 while draining, request metrics.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and websockets pass through
untouched and a request counts as in flight until its last body byte is sent.
"""

from __future__ import annotations

import time
from typing import Any

from omnistage.serving.errors import error_body

# Probes and scrapes: never counted as work, always answered (also while draining).
SYSTEM_PATHS = frozenset({"/health", "/ready", "/metrics", "/v1/models"})


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
        system = path in SYSTEM_PATHS or path.startswith("/v1/models/")
        if self.registry.draining and not system:
            await _reject_draining(kind, send)
            self.metrics.observe(scope.get("method", "WS"), "draining", 503, 0.0)
            return
        # Label: the HTTP status; for websockets 101 once accepted, 403 if closed before that.
        status = {"code": 500}

        async def send_wrapper(message):
            kind_ = message["type"]
            if kind_ == "http.response.start":
                status["code"] = message["status"]
            elif kind_ == "websocket.accept":
                status["code"] = 101
            elif kind_ == "websocket.close" and status["code"] == 500:
                status["code"] = 403
            await send(message)

        start = time.perf_counter()
        if not system:
            self.registry.inflight += 1
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if not system:
                self.registry.inflight -= 1
            route = scope.get("route")
            route_path = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "WS")
            self.metrics.observe(method, route_path, status["code"], time.perf_counter() - start)


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
