"""Probes and metrics: /health (liveness), /ready (readiness), /metrics (Prometheus)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from omnistage.serving.metrics import PROMETHEUS_MEDIA_TYPE

router = APIRouter(tags=["system"])


@router.get("/health")
async def health(request: Request) -> dict:
    """Liveness: 200 as long as the process serves HTTP (also while loading or draining)."""
    registry = request.app.state.registry
    status = "draining" if registry.draining else ("ok" if registry.ready else "starting")
    return {"status": status, "uptime_s": round(time.time() - registry.started_at, 3)}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once every stage of every pipeline is ready, 503 before and while draining."""
    detail = request.app.state.registry.readiness()
    return JSONResponse(detail, status_code=200 if detail["ready"] else 503)


# HEAD, as some load balancers probe: the same status, no body; out of the OpenAPI document
# (one operation per route and method there)
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
router.add_api_route("/ready", ready, methods=["HEAD"], include_in_schema=False)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    # Per-stage figures are asked of the worker processes (a busy worker answers after its
    # step): collect off the event loop so a scrape never stalls other requests.
    body = await asyncio.to_thread(request.app.state.metrics.render)
    return Response(body, media_type=PROMETHEUS_MEDIA_TYPE)
