"""`Prefer: respond-async` (RFC 7240) on the OpenAI routes: the request becomes a job.

A route that would otherwise wait for its pipeline calls `respond_async` first: when the
client prefers an asynchronous answer and this server runs jobs, the work is submitted as a
job (owned by the caller's key, like POST /v1/jobs) and the answer is 202 with the job's JSON,
`Location: /v1/jobs/{id}` and `Preference-Applied: respond-async`. The result is then read as
the job's outputs (GET /v1/jobs/{id}, its events, webhooks are not set this way). Without the
preference, or on a server without jobs, the route answers as usual (a preference may be
ignored).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from omnistage.serving.jobs.owners import owner_of


def prefers_async(request: Request) -> bool:
    """True when a Prefer header lists respond-async (several headers and lists allowed)."""
    for header in request.headers.getlist("prefer"):
        for preference in header.split(","):
            if preference.split(";")[0].strip().lower() == "respond-async":
                return True
    return False


def image_format(fmt: str, compression: int | None) -> str | dict[str, Any]:
    """An images route's output_format/output_compression as a job's output_format entry."""
    if compression is None or fmt == "png":
        return fmt
    return {"format": fmt, "quality": max(1, compression)}


async def respond_async(
    request: Request,
    *,
    model: str,
    inputs: dict[str, Any],
    params: dict[str, dict[str, Any]],
    output_format: dict[str, Any],
    metadata: dict[str, Any] | None = None,
) -> JSONResponse | None:
    """A 202 with the job that will do this request, or None: answer synchronously."""
    service = getattr(request.app.state, "jobs", None)
    if service is None or not prefers_async(request):
        return None
    job, created, shape = await service.submit(
        model=model, inputs=inputs, params=params, webhook=None, metadata=metadata or {}, priority=0,
        output_format=output_format, idempotency_key=request.headers.get("idempotency-key"),
        owner=owner_of(request),
    )  # fmt: skip
    headers = {"Location": f"/v1/jobs/{job.id}", "Preference-Applied": "respond-async"}
    if not created:
        headers["Idempotent-Replayed"] = "true"
    return JSONResponse(shape, status_code=202, headers=headers)
