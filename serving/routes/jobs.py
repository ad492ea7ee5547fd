"""Asynchronous jobs over any hosted pipeline (docs/jobs.md).

POST   /v1/jobs                       {model, inputs, params?, output_format?, webhook?, metadata?, priority?}
                                      -> 202 job; header Idempotency-Key: the same key, the same job
GET    /v1/jobs                       newest first; ?limit, ?after (a job id), ?model
GET    /v1/jobs/{id}                  status, progress, queue_position, timings, outputs, error, webhook attempts
DELETE /v1/jobs/{id}                  cancel a queued or running job (409 when it has finished)
GET    /v1/jobs/{id}/events           SSE of the job's event log; resumes after Last-Event-ID
GET    /v1/jobs/{id}/outputs/{name}   an output file (Range requests answered)
WS     /v1/jobs/{id}/stream           the events as JSON text frames, and as binary frames the video
                                      (fragmented-MP4 segments while the VAE decodes it) or the audio
                                      (WAV header + PCM16 chunks as the vocoder emits them)
GET    /v1/jobs/{id}/stream           the same bytes as one chunked download

The module's `lifespan` starts the JobService (serving/jobs/service.py) with JobsConfig.from_env():
with the default SQLite store the jobs directory must belong to this server alone (a lock file
says so; when another server holds it, the jobs routes answer 503); with a PostgreSQL store
(OMNISTAGE_JOBS_DB) several servers share the database and the outputs directory.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Header, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from omnistage.errors import InvalidRequestError
from omnistage.serving.errors import ServiceUnavailableError
from omnistage.serving.jobs.model import Job, JobsConfig, JobStatus
from omnistage.serving.jobs.outputs import output_files, output_formats, output_path
from omnistage.serving.jobs.owners import owner_of
from omnistage.serving.jobs.service import JobService, OutputNotFoundError
from omnistage.streaming.sse import SSE_HEADERS, SSE_MEDIA_TYPE, sse_comment, sse_event

log = logging.getLogger("omnistage.jobs")

CANCEL_WAIT_S = 5.0  # how long DELETE waits for a running job's stages to let it go
KEEPALIVE_S = 15.0
POLL_S = 1.0


def _finished(service: JobService, job_id: str) -> bool:
    job = service.store.get_job(job_id)
    return job is None or job.status.finished


@asynccontextmanager
async def lifespan(app: FastAPI):
    config = JobsConfig.from_env()
    config.directory.mkdir(parents=True, exist_ok=True)
    if config.db_url:  # a shared store: several servers on purpose, no directory lock
        service = JobService(app.state.registry, config)
        await service.start()
        app.state.jobs = service
        try:
            yield
        finally:
            await service.stop()
        return
    lock = open(config.directory / "server.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.warning("jobs are off: another server holds %s (set OMNISTAGE_JOBS_DIR)", config.directory)
        app.state.jobs = None
        lock.close()
        yield
        return
    lock.write(str(os.getpid()))
    lock.flush()
    service = JobService(app.state.registry, config)
    await service.start()
    app.state.jobs = service
    try:
        yield
    finally:
        await service.stop()
        lock.close()


router = APIRouter(tags=["jobs"])


class WebhookSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    events: list[str] | None = None
    secret: str | None = None  # whsec_...; the server's secrets sign when absent


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 400 naming it, not ignored

    model: str
    inputs: dict[str, Any]
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    output_format: dict[str, str | dict[str, Any]] = Field(default_factory=dict)
    webhook: WebhookSpec | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    priority: int = 0


def jobs_service(request: Request) -> JobService:
    service = getattr(request.app.state, "jobs", None)
    if service is None:
        raise ServiceUnavailableError("jobs are not available on this server", code="jobs_unavailable")
    return service


@router.post("/v1/jobs", status_code=202)
async def create_job(
    body: JobCreate, request: Request, idempotency_key: str | None = Header(default=None, alias="Idempotency-Key")
):
    service = jobs_service(request)
    job, created, shape = await service.submit(
        model=body.model,
        inputs=body.inputs,
        params=body.params,
        webhook=body.webhook.model_dump() if body.webhook is not None else None,
        metadata=body.metadata,
        priority=body.priority,
        output_format=body.output_format,
        idempotency_key=idempotency_key,
        owner=owner_of(request),
    )
    headers = {"Location": f"/v1/jobs/{job.id}"}
    if not created:
        headers["Idempotent-Replayed"] = "true"
    return JSONResponse(shape, status_code=202, headers=headers)


@router.get("/v1/jobs")
async def list_jobs(
    request: Request,
    limit: int = Query(default=20, ge=1, le=100),
    after: str | None = None,
    model: str | None = None,
) -> dict:
    service = jobs_service(request)
    service.check_cursor(after, owner_of(request))
    jobs = service.store.list_jobs(limit + 1, after=after, model=model, owner=owner_of(request))
    return {"object": "list", "data": [service.job_json(j) for j in jobs[:limit]], "has_more": len(jobs) > limit}


@router.get("/v1/jobs/{job_id}")
async def retrieve_job(job_id: str, request: Request) -> dict:
    service = jobs_service(request)
    return service.job_json(service.get(job_id, owner_of(request)))


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(job_id: str, request: Request) -> dict:
    service = jobs_service(request)
    await service.cancel(job_id, owner_of(request))
    task = service.scheduler.running.get(job_id)
    if task is not None:
        await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
    return service.job_json(service.get(job_id, owner_of(request)))


@router.get("/v1/jobs/{job_id}/outputs/{name}")
async def job_output(job_id: str, name: str, request: Request):
    service = jobs_service(request)
    job = service.get(job_id, owner_of(request))
    path = output_path(service.config.outputs_dir, job.id, name)
    media_type = next((f["media_type"] for f in output_files(job.outputs) if f["name"] == name), None)
    if path is None or media_type is None:
        raise OutputNotFoundError(job, name)
    return FileResponse(path, media_type=media_type, filename=name, content_disposition_type="inline")


@router.get("/v1/jobs/{job_id}/events")
async def job_events(
    job_id: str, request: Request, last_event_id: str | None = Header(default=None, alias="Last-Event-ID")
):
    service = jobs_service(request)
    service.get(job_id, owner_of(request))
    try:
        after = int(last_event_id) if last_event_id else 0
    except ValueError:
        after = 0

    async def events():
        nonlocal after
        idle = 0
        last_read = False
        while True:
            finished = False
            change = service.changed.mark()
            for event in service.store.events_after(job_id, after):
                after = event.seq
                yield sse_event({"type": event.type, "job_id": job_id, "created_at": event.created_at,
                                 **event.data}, event=event.type, id=str(event.seq))  # fmt: skip
                finished = event.type in ("completed", "failed", "canceled")
            if finished or last_read:
                return
            if idle == 0 and _finished(service, job_id):
                # the end event commits with the status, maybe after the read above: read once more
                last_read = True
                continue
            idle = 0 if await service.changed.wait(POLL_S, change) else idle + 1
            if idle and idle % int(KEEPALIVE_S / POLL_S) == 0:
                yield sse_comment("keep-alive")

    return StreamingResponse(events(), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)


@router.websocket("/v1/jobs/{job_id}/stream")
async def job_stream(websocket: WebSocket, job_id: str):
    service = getattr(websocket.app.state, "jobs", None)
    job = service.store.get_job(job_id) if service is not None else None
    owner = owner_of(websocket)
    if job is not None and owner is not None and job.owner != owner:
        job = None  # another key's job: as absent as an unknown one
    if job is None:
        await websocket.close(code=1008, reason="jobs unavailable" if service is None else "job not found")
        return
    await websocket.accept()
    try:
        await _send_stream(websocket, service, job_id)
        await websocket.close(code=1000)
    except WebSocketDisconnect:
        pass


async def _send_stream(websocket: WebSocket, service: JobService, job_id: str) -> None:
    after, sent, live = 0, 0, None
    while True:
        change = service.changed.mark()
        live = live or service.scheduler.live.get(job_id)
        if live is not None:
            for segment in live.segments[sent:]:
                await websocket.send_bytes(segment)
            sent = len(live.segments)
        for event in service.store.events_after(job_id, after):
            after = event.seq
            if event.type == "completed" and live is None:  # finished before this client came
                await _send_file(websocket, service, job_id)
            elif event.type == "completed":  # the muxer's last segment came after the read above
                for segment in live.segments[sent:]:
                    await websocket.send_bytes(segment)
                sent = len(live.segments)
            await websocket.send_json({"id": event.seq, "type": event.type, "job_id": job_id, **event.data})
            if event.type in ("completed", "failed", "canceled"):
                return
        await service.changed.wait(POLL_S, change)


async def _send_file(websocket: WebSocket, service: JobService, job_id: str) -> None:
    job = service.store.get_job(job_id)
    path = _stream_file(service, job) if job is not None else None
    if path is not None:
        await websocket.send_bytes(await asyncio.to_thread(path.read_bytes))


@router.get("/v1/jobs/{job_id}/stream")
async def job_stream_download(job_id: str, request: Request):
    service = jobs_service(request)
    job = service.get(job_id, owner_of(request))
    streamed = [f for f in _formats(service, job).values() if f.media_type in STREAMED_MEDIA_TYPES]
    if not streamed:
        raise InvalidRequestError(f"job {job_id} has no MP4 video or WAV/PCM audio output to stream", param="id")

    async def segments():
        sent, live = 0, None
        while True:
            change = service.changed.mark()
            live = live or service.scheduler.live.get(job_id)
            if live is not None:
                for segment in live.segments[sent:]:
                    yield segment
                sent = len(live.segments)
                if live.done:
                    return
            else:
                current = service.store.get_job(job_id)
                if current is None or current.status.finished:
                    if current is not None and current.status is JobStatus.COMPLETED:
                        path = _stream_file(service, current)
                        if path is not None:
                            yield await asyncio.to_thread(path.read_bytes)
                    return
            await service.changed.wait(POLL_S, change)

    return StreamingResponse(segments(), media_type=streamed[0].media_type)


def _formats(service: JobService, job: Job) -> dict:
    entry = service.registry.entry(job.model)
    spec = None if entry is None else entry.effective_spec
    return output_formats(spec, job.output_format) if spec is not None else {}


STREAMED_MEDIA_TYPES = ("video/mp4", "audio/wav", "audio/pcm")  # what /stream carries as it is made


def _stream_file(service: JobService, job: Job):
    for value in job.outputs.values():
        for file in value.get("files", ()) if isinstance(value, dict) else ():
            if file["media_type"] in STREAMED_MEDIA_TYPES:
                return output_path(service.config.outputs_dir, job.id, file["name"])
    return None
