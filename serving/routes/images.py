"""POST /v1/images/generations on pipelines that `serves: images`.

`size` becomes width/height, `n` num_images_per_prompt, and the extras (negative_prompt,
num_inference_steps, guidance_scale, seed) go to the `params:` stages that declare them; the
`image` role's port ([n, H, W, 3]) is encoded as png, jpeg or webp and returned as b64_json or,
with `response_format: "url"`, as a URL the server answers for a retention period
(image_files.py). `stream: true` answers with image_generation.partial_image events (the
`preview` role's port, `partial_images` of them) and image_generation.completed events
(image_stream.py). /v1/images/edits (image_edits.py) shares all of this.
Not served (400 naming the field): a transparent background, style.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from omnistage.errors import InvalidRequestError
from omnistage.serving.deps import unless_disconnected
from omnistage.serving.jobs.respond_async import image_format, respond_async
from omnistage.serving.media import MediaFormat, encode_media
from omnistage.serving.routes.image_files import image_store, image_url
from omnistage.serving.routes.request_base import OpenAIRequest
from omnistage.serving.routes.served import Served, UnsupportedError, invalid, new_id, now, served_pipeline

router = APIRouter(tags=["openai"])

MAX_IMAGES = 10
MAX_PARTIAL_IMAGES = 3  # OpenAI's bound
SIZE = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*)$")
OutputFormat = Literal["png", "jpeg", "webp"]


class ImageGenerationRequest(OpenAIRequest):
    model: str
    prompt: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=MAX_IMAGES)
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, or auto (the model's default)")
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: OutputFormat = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100, description="jpeg/webp quality, 100 = best")
    background: Literal["auto", "opaque", "transparent"] | None = None
    quality: Literal["auto", "standard", "hd", "low", "medium", "high"] | None = None
    style: Literal["vivid", "natural"] | None = None
    moderation: Literal["auto", "low"] | None = None
    stream: bool = False
    partial_images: int | None = Field(default=None, ge=0, le=MAX_PARTIAL_IMAGES)
    user: str | None = None
    safety_identifier: str | None = None
    # extras (diffusers' names)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0)
    seed: int | None = None


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    background: str | None = None
    output_format: str
    size: str | None = None
    quality: str | None = None
    warnings: list[str] | None = Field(default=None, description="extra: the stages' notices, e.g. a truncated prompt")


@dataclass
class ImageJob:
    """What the generations and edits routes hand to the pipeline, and how the answer looks."""

    served: Served
    inputs: dict[str, Any]
    params: dict[str, dict[str, Any]]
    output_format: str
    output_compression: int | None
    response_format: str
    quality: str | None

    def encode(self, images: Any) -> list[bytes]:
        """[n, H, W, 3] pixels -> one file per image in the requested format."""
        quality = self.output_compression if self.output_format != "png" else None
        options = (("quality", max(1, quality)),) if quality is not None else ()
        media = MediaFormat(self.served.port("image"), "image", self.output_format, options)
        return [encode_media(images[i], media) for i in range(images.shape[0])]

    def item(self, request: Request, data: bytes) -> dict[str, Any]:
        if self.response_format == "url":
            return {
                "url": image_url(request, image_store(request).put(data, self.output_format)),
                "revised_prompt": None,
            }
        return {"b64_json": base64.b64encode(data).decode("ascii"), "revised_prompt": None}


def refuse_unservable(served: Served, body: Any) -> None:
    """400s for what the pipeline cannot honour, naming the field."""
    if body.background == "transparent":
        raise UnsupportedError("transparent backgrounds are not supported", "background")
    if getattr(body, "style", None) is not None:
        raise UnsupportedError("style is not supported", "style")
    if body.partial_images and not body.stream:
        raise UnsupportedError("partial_images needs stream: true", "partial_images")
    if body.partial_images and served.port("preview") is None:
        raise UnsupportedError(
            f"the pipeline {served.name!r} streams no partial images (no preview port in its serves: images)",
            "partial_images",
        )
    if body.stream and body.n > 1:
        raise UnsupportedError("a streamed answer carries one image; n must be 1 with stream: true", "n")
    if body.stream and body.response_format == "url":
        raise UnsupportedError("streamed images come as b64_json; leave response_format out", "response_format")


def size_fields(size: str | None) -> dict[str, int]:
    if size is None or size == "auto":
        return {}
    match = SIZE.match(size)
    if match is None:
        raise invalid(f"size must be WIDTHxHEIGHT (e.g. 64x64) or auto, got {size!r}", "size", code="invalid_size")
    return {"width": int(match.group(1)), "height": int(match.group(2))}


def generation_fields(body: Any, **more: Any) -> dict[str, Any]:
    """The request's fields in the diffusion stages' names (None left out)."""
    fields = {
        "negative_prompt": body.negative_prompt,
        "num_inference_steps": body.num_inference_steps,
        "guidance_scale": body.guidance_scale,
        "seed": body.seed,
        "num_images_per_prompt": body.n if body.n > 1 else None,
        "partial_images": body.partial_images or None,
        **size_fields(body.size),
        **more,
    }
    return {k: v for k, v in fields.items() if v is not None}


async def run_images(request: Request, job: ImageJob) -> dict[str, Any]:
    """The pipeline's outputs; a stage's complaint about width/height names `size`."""
    pipeline = job.served.pipeline
    try:
        outputs = await unless_disconnected(
            request, pipeline.generate(job.inputs, job.params, request_id=new_id("img"))
        )
    except InvalidRequestError as err:
        rename_size_param(err)
        raise
    return outputs


def rename_size_param(err: InvalidRequestError) -> None:
    if getattr(err, "param", None) in ("width", "height"):  # the stage names its own field
        err.param = "size"


def images_response(request: Request, job: ImageJob, outputs: dict[str, Any]) -> JSONResponse:
    images = outputs[job.served.port("image")]
    height, width = int(images.shape[1]), int(images.shape[2])
    body = {
        "created": now(),
        "data": [job.item(request, f) for f in job.encode(images)],
        "background": "opaque",
        "output_format": job.output_format,
        "size": f"{width}x{height}",
        "quality": job.quality,
    }
    # extra (not OpenAI's): what the stages noted, e.g. a prompt truncated to the encoder's length
    port = job.served.port("warnings")
    warnings = outputs.get(port) if port is not None else None
    if warnings:
        body["warnings"] = list(warnings)
    return JSONResponse(body)


@router.post(
    "/v1/images/generations",
    response_model=ImagesResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def generate_images(body: ImageGenerationRequest, request: Request):
    served = served_pipeline(request, body.model, "images")
    refuse_unservable(served, body)
    params = served.stage_params(generation_fields(body))
    job = ImageJob(
        served,
        {served.port("prompt"): body.prompt},
        params,
        body.output_format,
        body.output_compression,
        body.response_format,
        body.quality,
    )
    try:
        accepted = await respond_async(  # Prefer: respond-async -> 202 and a job (serving/jobs/respond_async.py)
            request, model=served.name, inputs=job.inputs, params=params,
            output_format={served.port("image"): image_format(body.output_format, body.output_compression)},
        )  # fmt: skip
    except InvalidRequestError as err:
        rename_size_param(err)
        raise
    if accepted is not None:
        return accepted
    if body.stream:
        from omnistage.serving.routes.image_stream import stream_images

        return await stream_images(request, job, "image_generation")
    return images_response(request, job, await run_images(request, job))
