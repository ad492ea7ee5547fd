"""POST /v1/images/generations on pipelines that `serves: images`.

`size` becomes width/height, `n` num_images_per_prompt, and the extras (negative_prompt,
num_inference_steps, guidance_scale, seed) go to the `params:` stages that declare them; the
`image` role's port ([n, H, W, 3]) is encoded as png, jpeg or webp and returned as b64_json.
Not served (400 naming the field): response_format url (the server stores no files), a
transparent background, streaming partial images.
"""

from __future__ import annotations

import base64
import re
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from omnistage.errors import InvalidRequestError
from omnistage.serving.deps import unless_disconnected
from omnistage.serving.media import MediaFormat, encode_media
from omnistage.serving.routes.served import UnsupportedError, invalid, new_id, now, served_pipeline

router = APIRouter(tags=["openai"])

MAX_IMAGES = 10
SIZE = re.compile(r"^([1-9][0-9]*)x([1-9][0-9]*)$")


class ImageGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=MAX_IMAGES)
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, or auto (the model's default)")
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100, description="jpeg/webp quality, 100 = best")
    background: Literal["auto", "opaque", "transparent"] | None = None
    quality: Literal["auto", "standard", "hd", "low", "medium", "high"] | None = None
    style: Literal["vivid", "natural"] | None = None
    moderation: Literal["auto", "low"] | None = None
    stream: bool = False
    partial_images: int | None = Field(default=None, ge=0, le=3)
    user: str | None = None
    # extras (diffusers' names)
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0)
    seed: int | None = None


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    background: str | None = None
    output_format: str
    size: str | None = None
    quality: str | None = None


def _refusals(body: ImageGenerationRequest) -> None:
    if body.response_format == "url":
        raise UnsupportedError("response_format url is not served (no file storage); use b64_json", "response_format")
    if body.background == "transparent":
        raise UnsupportedError("transparent backgrounds are not supported", "background")
    if body.stream:
        raise UnsupportedError("streamed partial images are not supported yet", "stream")
    if body.style is not None:
        raise UnsupportedError("style is not supported", "style")


def _size(size: str | None) -> dict[str, int]:
    if size is None or size == "auto":
        return {}
    match = SIZE.match(size)
    if match is None:
        raise invalid(f"size must be WIDTHxHEIGHT (e.g. 64x64) or auto, got {size!r}", "size", code="invalid_size")
    return {"width": int(match.group(1)), "height": int(match.group(2))}


@router.post("/v1/images/generations", response_model=ImagesResponse)
async def generate_images(body: ImageGenerationRequest, request: Request):
    served = served_pipeline(request, body.model, "images")
    _refusals(body)
    extras = {
        "negative_prompt": body.negative_prompt,
        "num_inference_steps": body.num_inference_steps,
        "guidance_scale": body.guidance_scale,
        "seed": body.seed,
        "num_images_per_prompt": body.n if body.n > 1 else None,
        **_size(body.size),
    }
    params = served.stage_params({k: v for k, v in extras.items() if v is not None})
    inputs = {served.port("prompt"): body.prompt}
    try:
        outputs = await unless_disconnected(request, served.pipeline.generate(inputs, params, request_id=new_id("img")))
    except InvalidRequestError as err:
        if getattr(err, "param", None) in ("width", "height"):  # the stage names its own field
            err.param = "size"
        raise
    images = outputs[served.port("image")]
    quality = body.output_compression if body.output_format != "png" else None
    options = (("quality", max(1, quality)),) if quality is not None else ()
    media = MediaFormat(served.port("image"), "image", body.output_format, options)
    files = [encode_media(images[i], media) for i in range(images.shape[0])]
    height, width = int(images.shape[1]), int(images.shape[2])
    return JSONResponse(
        {
            "created": now(),
            "data": [{"b64_json": base64.b64encode(f).decode("ascii"), "revised_prompt": None} for f in files],
            "background": "opaque",
            "output_format": body.output_format,
            "size": f"{width}x{height}",
            "quality": body.quality,
        }
    )
