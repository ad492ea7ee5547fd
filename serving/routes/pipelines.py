"""Generic pipeline calls over JSON: POST /v1/pipelines/{name}/run (optionally streamed as SSE).

The protocol-specific routes (chat, speech, images) come as their own routers; this one
exposes any hosted pipeline as it is, which is what tests, debugging and glue code need.
Request:  {"inputs": {port: value}, "params": {stage: {...}}, "stream": false, "timeout": null}
Inputs of tensor-like port types are built with torch.tensor(value) (int64 for `tokens`,
float32 for tensor, embeddings, audio, ...); text/json/any are passed through. Outputs: tensors become nested lists.
Streamed: one SSE event per chunk {"port", "data", "final", "stage", "progress"}, then [DONE].
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from omnistage.errors import InvalidRequestError, OmnistageError
from omnistage.serving.deps import get_pipeline, unless_disconnected
from omnistage.streaming.sse import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, sse_event

router = APIRouter(tags=["pipelines"])

PASS_THROUGH_TYPES = ("text", "json", "any")


class RunRequest(BaseModel):
    inputs: dict[str, Any]
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    stream: bool = False
    timeout: float | None = Field(default=None, gt=0)


def _to_inputs(spec: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    import torch

    out = {}
    # Which inputs a request must give is the pipeline's business (some are alternatives,
    # e.g. prompt | messages | tokens); here only the names and value shapes are checked.
    for port, port_type in spec.inputs.items():
        if port not in inputs:
            continue
        value = inputs[port]
        if port_type in PASS_THROUGH_TYPES:
            out[port] = value
            continue
        # JSON numbers: token ids are integers, every other tensor-like port is float32.
        dtype = torch.long if port_type == "tokens" else torch.float32
        try:
            out[port] = torch.tensor(value, dtype=dtype)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidRequestError(
                f"input {port!r} ({port_type}) is not a numeric array: {exc}", param=f"inputs.{port}"
            ) from exc
    unknown = set(inputs) - set(spec.inputs)
    if unknown:
        raise InvalidRequestError(
            f"unknown input port(s): {', '.join(sorted(unknown))} (pipeline inputs: {', '.join(spec.inputs)})",
            param="inputs",
        )
    if not out:
        raise InvalidRequestError(f"no inputs given (pipeline inputs: {', '.join(spec.inputs)})", param="inputs")
    return out


def to_jsonable(value: Any) -> Any:
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if value.dtype.is_floating_point:
            value = value.float()
        return value.tolist()
    if hasattr(value, "tolist"):  # numpy
        return value.tolist()
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, bytes):
        raise InvalidRequestError("this pipeline returns binary data; use a media route")
    return value


@router.post("/v1/pipelines/{name}/run")
async def run_pipeline(name: str, body: RunRequest, request: Request):
    pipeline = get_pipeline(request, name)
    inputs = _to_inputs(pipeline.spec, body.inputs)
    request_id = f"run-{uuid.uuid4().hex[:16]}"
    if not body.stream:
        outputs = await unless_disconnected(
            request, pipeline.generate(inputs, body.params, request_id=request_id, deadline_s=body.timeout)
        )
        return {
            "id": request_id,
            "object": "pipeline.run",
            "model": name,
            "outputs": {port: to_jsonable(v) for port, v in outputs.items()},
        }

    stream = pipeline.stream(inputs, body.params, request_id=request_id, deadline_s=body.timeout)

    async def events():
        try:
            async for chunk in stream:
                yield sse_event(
                    {
                        "id": request_id,
                        "port": chunk.port,
                        "stage": chunk.stage,
                        "final": chunk.final,
                        "progress": chunk.progress,
                        "data": to_jsonable(chunk.data),
                    }
                )
        except OmnistageError as err:  # headers are gone: report the error in-band
            yield sse_event(
                {
                    "error": {
                        "message": str(err),
                        "type": "server_error" if err.status >= 500 else "invalid_request_error",
                        "param": getattr(err, "param", None),
                        "code": err.code,
                    }
                }
            )
        finally:
            await stream.aclose()
        yield SSE_DONE

    return StreamingResponse(events(), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
