"""OpenAI's video API as a thin shape over jobs (docs/jobs.md, "OpenAI's /v1/videos").

POST   /v1/videos                  form or JSON: prompt, model?, seconds?, size? (and the extra
                                   seed, negative_prompt, num_inference_steps, guidance_scale)
                                   -> a video job
GET    /v1/videos                  newest first: ?limit, ?after
GET    /v1/videos/{id}             status queued | in_progress | completed | failed, integer progress
GET    /v1/videos/{id}/content     ?variant=video (MP4, range requests) | thumbnail (WebP of frame 0)
DELETE /v1/videos/{id}             cancels a running video and deletes it

A model is a hosted pipeline with a `text` input named `prompt` and one `video` output. `size`
"WxH" sets the diffusion stages' width and height; `seconds` sets num_frames at the pipeline's
frame rate, rounded to the 4k+1 frames the Wan VAE takes. A video's id is its job's id.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse

from omnistage.errors import InvalidRequestError
from omnistage.serving.errors import ModelNotFoundError
from omnistage.serving.jobs.model import Job, JobStatus
from omnistage.serving.jobs.outputs import delete_outputs, output_path
from omnistage.serving.jobs.owners import owner_of
from omnistage.serving.jobs.service import JobNotFoundError, JobService
from omnistage.serving.media import DEFAULT_FPS
from omnistage.serving.routes.jobs import jobs_service

router = APIRouter(tags=["videos"])

# extra fields (not OpenAI's), as /v1/images takes them: what makes a video reproducible
EXTRA_FIELDS: dict[str, type] = {
    "seed": int,
    "negative_prompt": str,
    "num_inference_steps": int,
    "guidance_scale": float,
}
FIELDS = ("prompt", "model", "seconds", "size", "input_reference", *EXTRA_FIELDS)


async def _body(request: Request) -> dict[str, Any]:
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("application/json"):
        body = await request.json()
        if not isinstance(body, dict):
            raise InvalidRequestError("the body must be a JSON object", param=None)
        return body
    form = await request.form()
    return {key: form.get(key) for key in form.keys()}


def video_port(spec: Any) -> str | None:
    """The video output of a pipeline /v1/videos serves (a `prompt` text input and one video
    output), or None."""
    ports = [p for p, t in spec.outputs.items() if t == "video"] if spec is not None else []
    return ports[0] if len(ports) == 1 and spec.inputs.get("prompt") == "text" else None


def _video_pipeline(request: Request, model: str | None) -> tuple[str, Any, str]:
    """(name, spec, video port) of the pipeline `model` names (default: the only video one)."""
    registry = request.app.state.registry
    candidates = []
    for entry in registry.entries():
        spec = entry.effective_spec
        port = video_port(spec)
        if port is not None:
            candidates.append((entry.name, spec, port))
    if model is None:
        if len(candidates) != 1:
            raise InvalidRequestError(
                "name the video model (hosted: " + ", ".join(c[0] for c in candidates) + ")", "model"
            )
        return candidates[0]
    for candidate in candidates:
        if candidate[0] == model:
            return candidate
    if registry.entry(model) is not None:
        raise InvalidRequestError(f"model {model!r} does not make videos from a prompt", param="model")
    raise ModelNotFoundError(model, registry.names())


def _generation(seconds: Any, size: Any) -> dict[str, Any]:
    generation: dict[str, Any] = {}
    if size is not None:
        try:
            width, height = (int(v) for v in str(size).lower().split("x"))
        except ValueError:
            raise InvalidRequestError(f"size must be WIDTHxHEIGHT, not {size!r}", param="size") from None
        generation.update(width=width, height=height)
    if seconds is not None:
        try:
            value = float(seconds)
        except ValueError:
            raise InvalidRequestError(f"seconds must be a number, not {seconds!r}", param="seconds") from None
        if not (math.isfinite(value) and value > 0):
            raise InvalidRequestError(f"seconds must be a positive number, not {seconds!r}", param="seconds")
        generation["num_frames"] = 4 * max(1, round(value * DEFAULT_FPS / 4)) + 1
    return generation


def _extras(body: dict[str, Any]) -> dict[str, Any]:
    """The extra fields given; a form's text becomes the field's type (JSON's values are checked
    by the stages that take them)."""
    extras = {}
    for name, kind in EXTRA_FIELDS.items():
        value = body.get(name)
        if isinstance(value, str) and kind is not str:
            try:
                value = kind(value)
            except ValueError:
                raise InvalidRequestError(
                    f"{name} must be a number ({kind.__name__}), not {value!r}", param=name
                ) from None
        if value is not None:
            extras[name] = value
    return extras


def _shown_size(name: str, spec: Any, body: dict[str, Any], service: JobService) -> dict[str, Any]:
    """`seconds` and `size` as the video object shows them: as asked, or else the model's
    defaults (None when its checkpoint is not on disk yet)."""
    from omnistage.stages.diffusion.limits import denoiser_limits

    seconds, size = body.get("seconds"), body.get("size")
    if seconds is None or size is None:
        entry = service.registry.entry(name)
        limits = denoiser_limits(spec) if entry is not None and entry.is_ready() else None
        if limits is not None:
            d = limits.defaults
            seconds = seconds if seconds is not None else f"{((d.num_frames or 1) - 1) / DEFAULT_FPS:g}"
            size = size if size is not None else f"{d.width}x{d.height}"
    return {"seconds": seconds, "size": size}


def video_json(service: JobService, job: Job) -> dict[str, Any]:
    status = {JobStatus.CANCELED: "failed"}.get(job.status, job.status.value)
    error = job.error
    if job.status is JobStatus.CANCELED:
        error = {"code": "canceled", "message": "the video was canceled"}
    percent = 100 if job.status is JobStatus.COMPLETED else service.job_json(job)["progress"]["percent"]
    return {
        "id": job.id,
        "object": "video",
        "model": job.model,
        "status": status,
        "progress": percent,
        "created_at": int(job.created_at),
        "completed_at": int(job.finished_at) if job.status is JobStatus.COMPLETED else None,
        "expires_at": int(job.expires_at) if job.expires_at else None,
        "prompt": job.metadata.get("prompt"),
        "seconds": job.metadata.get("seconds"),
        "size": job.metadata.get("size"),
        "remixed_from_video_id": None,
        "error": {"code": error.get("code"), "message": error.get("message")} if error else None,
    }


def _video(service: JobService, video_id: str, request: Request) -> Job:
    job = service.get(video_id, owner_of(request))
    if job.api != "videos":
        raise JobNotFoundError(video_id)
    return job


@router.post("/v1/videos")
async def create_video(request: Request):
    service = jobs_service(request)
    body = await _body(request)
    unknown = set(body) - set(FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown field(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequestError("prompt is required", param="prompt")
    if body.get("input_reference") is not None:
        raise InvalidRequestError("input_reference: these pipelines take no reference image", param="input_reference")
    name, spec, port = _video_pipeline(request, body.get("model"))
    from omnistage.stages.diffusion import stage_params

    generation = {**_generation(body.get("seconds"), body.get("size")), **_extras(body)}
    try:
        job, _, _ = await service.submit(
            model=name,
            inputs={"prompt": prompt},
            params=stage_params(spec, generation),
            webhook=None,
            metadata={"prompt": prompt, **_shown_size(name, spec, body, service), "port": port},
            priority=0,
            output_format={port: "mp4"},
            idempotency_key=request.headers.get("idempotency-key"),
            api="videos",
            owner=owner_of(request),
        )
    except InvalidRequestError as exc:
        raise _in_video_terms(exc, body, generation) from None
    return JSONResponse(video_json(service, job))


def _in_video_terms(exc: InvalidRequestError, body: dict[str, Any], generation: dict[str, Any]) -> InvalidRequestError:
    """A stage's refusal of the frames or the size this route derived, named as the client
    asked: `seconds` or `size`."""
    if exc.param == "num_frames" and "num_frames" in generation:
        frames = generation["num_frames"]
        return InvalidRequestError(
            f"seconds={body['seconds']} is {frames} frames at {DEFAULT_FPS} fps, which this model cannot make: {exc}",
            param="seconds",
        )
    if exc.param in ("width", "height") and "width" in generation:
        return InvalidRequestError(f"size={body['size']} is not a size this model makes: {exc}", param="size")
    return exc


@router.get("/v1/videos")
async def list_videos(request: Request, limit: int = Query(default=20, ge=1, le=100), after: str | None = None):
    service = jobs_service(request)
    service.check_cursor(after, owner_of(request), api="videos")
    jobs = service.store.list_jobs(limit + 1, after=after, api="videos", owner=owner_of(request))
    data = [video_json(service, j) for j in jobs[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(jobs) > limit,
    }


@router.get("/v1/videos/{video_id}")
async def retrieve_video(video_id: str, request: Request):
    service = jobs_service(request)
    return video_json(service, _video(service, video_id, request))


@router.get("/v1/videos/{video_id}/content")
async def video_content(video_id: str, request: Request, variant: str = "video"):
    service = jobs_service(request)
    job = _video(service, video_id, request)
    if variant not in ("video", "thumbnail"):
        raise InvalidRequestError(f"variant must be video or thumbnail, not {variant!r}", param="variant")
    if job.status is not JobStatus.COMPLETED:
        raise InvalidRequestError(f"video {video_id} is {video_json(service, job)['status']}, not completed", "id")
    files = job.outputs[job.metadata["port"]]["files"]
    path = output_path(service.config.outputs_dir, job.id, files[0]["name"])
    if path is None:
        raise JobNotFoundError(video_id)
    if variant == "video":
        return FileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4", content_disposition_type="inline")
    thumb = path.with_name("thumbnail.webp")
    if not thumb.exists():
        await asyncio.to_thread(_write_thumbnail, path, thumb)
    return FileResponse(thumb, media_type="image/webp")


def _write_thumbnail(video: Any, thumb: Any) -> None:
    import av

    from omnistage.streaming.images import encode_image

    with av.open(str(video)) as container:
        frame = next(container.decode(video=0)).to_ndarray(format="rgb24")
    tmp = thumb.with_name(".thumbnail.tmp")
    tmp.write_bytes(encode_image(frame, "webp", quality=100))  # 100: lossless, frame 0's own pixels
    tmp.replace(thumb)


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, request: Request):
    service = jobs_service(request)
    job = _video(service, video_id, request)
    if not job.status.finished:
        await service.cancel(video_id, owner_of(request))
        task = service.scheduler.running.get(video_id)
        if task is not None:
            await asyncio.wait({task}, timeout=5.0)
    await asyncio.to_thread(delete_outputs, service.config.outputs_dir, video_id)
    service.store.delete_job(video_id)
    return {"id": video_id, "object": "video.deleted", "deleted": True}
