"""`stream: true` on /v1/images/generations and /v1/images/edits: OpenAI's image streaming
events over SSE.

Each chunk of the `preview` role's port (the denoiser's estimate decoded at evenly spaced
steps, docs/diffusion.md) becomes a `<kind>.partial_image` event, numbered from 0 by
`partial_image_index`; the `image` port's final pixels become `<kind>.completed`. The stream
starts only once the pipeline has accepted the request, so a refusal keeps its HTTP status.
Fewer partial images than asked arrive when the request has too few steps to space them.
A streamed answer carries one image (n = 1), so a preview chunk's rows are successive previews
(the runtime joins chunks that arrive together). The stages' notices (the `warnings` role, such
as a truncated prompt) ride on the completed event, as they ride on the unstreamed answer.
"""

from __future__ import annotations

import base64
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from omnistage.errors import InvalidRequestError
from omnistage.serving.routes.images import ImageJob, rename_size_param
from omnistage.serving.routes.served import new_id, now
from omnistage.serving.routes.streams import first_then_rest, one_per_batch, sse_stream


def _event(job: ImageJob, kind: str, suffix: str, pixels: Any, **extra: Any) -> tuple[str, dict[str, Any]]:
    (data,) = job.encode(pixels[:1])
    height, width = int(pixels.shape[1]), int(pixels.shape[2])
    name = f"{kind}.{suffix}"
    return name, {
        "type": name,
        "b64_json": base64.b64encode(data).decode("ascii"),
        "created_at": now(),
        "size": f"{width}x{height}",
        "quality": job.quality or "auto",
        "background": "opaque",
        "output_format": job.output_format,
        **extra,
    }


async def stream_images(request: Request, job: ImageJob, kind: str) -> StreamingResponse:
    """`kind`: image_generation or image_edit (the events' prefix)."""
    stream = job.served.pipeline.stream(job.inputs, job.params, request_id=new_id("img"))
    try:
        rest = await first_then_rest(request, stream)
    except InvalidRequestError as err:
        await stream.aclose()
        rename_size_param(err)
        raise
    preview_port, image_port, warnings_port = (job.served.port(r) for r in ("preview", "image", "warnings"))
    usage = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}

    async def events():
        index, warnings, image = 0, [], None
        async for item in rest:
            if item.data is None or not len(item.data):
                continue
            if item.port == warnings_port and warnings_port is not None:
                warnings.extend(item.data)
            elif item.port == preview_port and preview_port is not None:
                for row in range(item.data.shape[0]):  # chunks that arrive together come joined
                    yield _event(job, kind, "partial_image", item.data[row : row + 1], partial_image_index=index)
                    index += 1
            elif item.port == image_port:
                image = item.data
        if image is not None:  # once the request has ended: a stage's notice may come after the image
            extra = {"warnings": warnings} if warnings else {}
            usage_ = {**usage, "output_tokens": 0, "total_tokens": 0}
            yield _event(job, kind, "completed", image, usage=usage_, **extra)

    return sse_stream(one_per_batch(events()), stream, done=False)
