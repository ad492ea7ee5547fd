"""POST /v1/images/edits (multipart) on pipelines whose `serves: images` names an `image_in`
port: image-to-image through the same pipeline as /v1/images/generations.

The uploaded image (png, jpeg or webp) is decoded to pixels and sent to the `image_in` port;
the denoiser encodes it with the VAE, noises it to `strength` (extra field, diffusers' name,
default 0.6) and denoises from there (stages/diffusion/img2img.py). `size` defaults to the
image's own size, rounded down (and scaled down, aspect kept) into the sizes the model makes.
A `mask` (a PNG of the image's size whose transparent pixels mark what to repaint, as OpenAI
documents it) becomes the alpha channel of the pixels sent: the denoiser
then inpaints (keeps the latents outside the mask). The answer is the generations route's
(b64_json or url, or SSE events named image_edit.* with stream: true). Not served (400
naming the field): several input images.
"""

from __future__ import annotations

import io
from typing import Annotated, Literal

import numpy as np
import torch
from fastapi import APIRouter, Depends, Form, Request, UploadFile
from pydantic import ConfigDict, Field

from omnistage.errors import InvalidRequestError
from omnistage.serving.routes.images import (
    MAX_IMAGES,
    MAX_PARTIAL_IMAGES,
    ImageJob,
    ImagesResponse,
    OutputFormat,
    generation_fields,
    images_response,
    refuse_unservable,
    run_images,
)
from omnistage.serving.routes.request_base import OpenAIRequest
from omnistage.serving.routes.served import UnsupportedError, invalid, served_pipeline
from omnistage.stages.media_limits import check_image_size, image_problem

router = APIRouter(tags=["openai"])


class ImageEditRequest(OpenAIRequest):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str
    prompt: str = Field(min_length=1)
    image: UploadFile | list[UploadFile] | None = None
    images: list[UploadFile] | None = Field(default=None, alias="image[]", description="the openai client's list form")
    mask: UploadFile | None = None
    n: int = Field(default=1, ge=1, le=MAX_IMAGES)
    size: str | None = Field(default=None, description="WIDTHxHEIGHT, or auto (the input image's size)")
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: OutputFormat = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)
    background: Literal["auto", "opaque", "transparent"] | None = None
    quality: Literal["auto", "standard", "low", "medium", "high"] | None = None
    input_fidelity: Literal["high", "low"] | None = None
    stream: bool = False
    partial_images: int | None = Field(default=None, ge=0, le=MAX_PARTIAL_IMAGES)
    user: str | None = None
    safety_identifier: str | None = None
    # extras (diffusers' names)
    strength: float | None = Field(default=None, ge=0, le=1, description="how far the image is noised (0-1)")
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0)
    seed: int | None = None

    def uploads(self) -> list[UploadFile]:
        given = self.image if isinstance(self.image, list) else [self.image] if self.image is not None else []
        return given + list(self.images or [])


async def _pixels(upload: UploadFile, param: str = "image", mode: str = "RGB") -> np.ndarray:
    from PIL import Image

    raw = await upload.read()
    try:
        with Image.open(io.BytesIO(raw)) as img:
            check_image_size(img.width, img.height, param)  # from the header, before any pixel
            if mode == "A" and not img.has_transparency_data:
                raise invalid(
                    f"{param} has no alpha channel; transparent pixels mark what to edit", param, "invalid_mask"
                )
            return np.asarray(img.convert("RGBA").getchannel("A") if mode == "A" else img.convert(mode))
    except InvalidRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - Pillow raises several kinds
        raise invalid(f"{param} is not a decodable image: {image_problem(exc)}", param, code="invalid_image") from exc


async def _with_mask(pixels: np.ndarray, mask: UploadFile) -> np.ndarray:
    """RGBA pixels whose alpha is the mask's: the denoiser repaints where it is transparent."""
    alpha = await _pixels(mask, "mask", mode="A")
    if alpha.shape != pixels.shape[:2]:
        (h, w), (mh, mw) = pixels.shape[:2], alpha.shape
        raise invalid(f"mask is {mw}x{mh} pixels; it must be the image's size, {w}x{h}", "mask", code="invalid_mask")
    return np.concatenate([pixels, alpha[..., None]], axis=-1)


def _output_size(served, height: int, width: int) -> dict[str, int]:
    """The input image's size, scaled down (aspect kept) and rounded down into the sizes the
    model makes, as diffusers' img2img pipelines round it: any input image can be edited."""
    from omnistage.stages.diffusion.limits import denoiser_limits

    limits = denoiser_limits(served.spec)
    if limits is not None:
        height, width = limits.sizes.fit(height, width)
    return {"width": width, "height": height}


def _multipart(request: Request) -> None:
    """A JSON body would be read as an empty form ("model: Field required" for a model that was
    sent): say what the route takes instead, before the form is parsed."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json":
        raise invalid(
            "/v1/images/edits takes multipart/form-data: the image as a file, the other fields as "
            "form fields (the openai client sends it so)",
            None,
        )


@router.post(
    "/v1/images/edits",
    dependencies=[Depends(_multipart)],
    response_model=ImagesResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
    # FastAPI documents a form model with files as urlencoded; the upload needs multipart
    openapi_extra={
        "requestBody": {
            "content": {"multipart/form-data": {"schema": {"$ref": "#/components/schemas/ImageEditRequest"}}}
        }
    },
)
async def edit_images(body: Annotated[ImageEditRequest, Form()], request: Request):
    served = served_pipeline(request, body.model, "images")
    if served.port("image_in") is None:
        raise UnsupportedError(f"the model {served.name!r} takes no input image (no image_in port)", "model")
    uploads = body.uploads()
    if not uploads:
        raise invalid("image is required (a png, jpeg or webp file)", "image", code="missing_required_parameter")
    if len(uploads) > 1:
        raise UnsupportedError("one input image per edit", "image")
    refuse_unservable(served, body)
    pixels = await _pixels(uploads[0])
    if body.mask is not None:
        pixels = await _with_mask(pixels, body.mask)
    size = {} if body.size not in (None, "auto") else _output_size(served, *pixels.shape[:2])
    params = served.stage_params(generation_fields(body, strength=body.strength, **size))
    inputs = {served.port("prompt"): body.prompt, served.port("image_in"): torch.from_numpy(pixels.copy())}
    job = ImageJob(
        served, inputs, params, body.output_format, body.output_compression, body.response_format, body.quality
    )
    if body.stream:
        from omnistage.serving.routes.image_stream import stream_images

        return await stream_images(request, job, "image_edit")
    return images_response(request, job, await run_images(request, job))
