"""Generic pipeline calls over JSON, and what each pipeline wants and gives.

GET  /v1/pipelines               every hosted pipeline: ports with their types
GET  /v1/pipelines/{name}        one pipeline: ports, every stage's per-request params, an example
POST /v1/pipelines/{name}/run    run it: {"inputs": {port: value}, "params": {stage: {...}},
                                  "stream": false, "timeout": null, "output_format": {port: fmt}}

Inputs of tensor-like port types are built with torch.tensor(value) (int64 for `tokens`,
float32 for tensor, embeddings, audio, ...); text/json/any are passed through. Outputs: tensors
become nested lists, media ports named in output_format become base64 files (serving/media.py),
and an Accept header naming a media type returns that one port's file itself.
Streamed: one SSE event per chunk {"port", "data", "final", "stage", "progress"}, then [DONE].
The stream's headers are sent with its first chunk, so a request refused before any output
(bad params, overload, a prompt too long) gets its HTTP status, as without streaming.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from omnistage.errors import InvalidRequestError, OmnistageError
from omnistage.serving.catalog import describe_pipeline
from omnistage.serving.deps import get_pipeline, get_registry, unless_disconnected
from omnistage.serving.errors import ModelNotFoundError
from omnistage.serving.jobs.owners import owner_of
from omnistage.serving.media import MediaFormat, encode_media, format_for_accept, media_json, parse_output_formats
from omnistage.serving.tenancy import salted
from omnistage.streaming.sse import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, sse_event

router = APIRouter(tags=["pipelines"])

PASS_THROUGH_TYPES = ("text", "json", "any")


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt `params` or `stream` is a 400, not ignored

    inputs: dict[str, Any]
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    stream: bool = False
    timeout: float | None = Field(default=None, gt=0)
    output_format: dict[str, str | dict[str, Any]] = Field(default_factory=dict)


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
        try:
            out[port] = torch.tensor(value, dtype=None if port_type == "tokens" else torch.float32)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidRequestError(
                f"input {port!r} ({port_type}) is not a numeric array: {exc}", param=f"inputs.{port}"
            ) from exc
        if port_type == "tokens" and out[port].dtype != torch.long:  # [1.7, 2.2] is refused, not truncated
            raise InvalidRequestError(f"input {port!r} (tokens) must hold integers only", param=f"inputs.{port}")
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


def _port_json(port: str | None, value: Any, formats: dict[str, MediaFormat]) -> Any:
    media = formats.get(port) if port is not None else None
    if media is not None and value is not None:
        return media_json(value, media)
    return to_jsonable(value)


@router.get("/v1/pipelines")
async def list_pipelines(request: Request) -> dict:
    registry = get_registry(request)
    return {"object": "list", "data": [describe_pipeline(e, detail=False) for e in registry.entries()]}


@router.get("/v1/pipelines/{name}")
async def retrieve_pipeline(name: str, request: Request) -> dict:
    registry = get_registry(request)
    entry = registry.entry(name)
    if entry is None:
        raise ModelNotFoundError(name, registry.names())
    return describe_pipeline(entry)


@router.post("/v1/pipelines/{name}/run")
async def run_pipeline(name: str, body: RunRequest, request: Request):
    pipeline = get_pipeline(request, name)
    spec = pipeline.spec
    inputs = _to_inputs(spec, body.inputs)
    formats = parse_output_formats(spec, body.output_format)
    as_file = format_for_accept(spec, request.headers.get("accept"))
    if as_file is not None and body.stream:
        raise InvalidRequestError(f"Accept: {as_file.media_type} answers a whole file; drop stream", param="stream")
    request_id = f"run-{uuid.uuid4().hex[:16]}"
    params = salted(spec, body.params, owner_of(request))
    if not body.stream:
        outputs = await unless_disconnected(
            request, pipeline.generate(inputs, params, request_id=request_id, deadline_s=body.timeout)
        )
        if as_file is not None:
            data = encode_media(outputs.get(as_file.port), as_file)
            if isinstance(data, list):
                raise InvalidRequestError(
                    f"output {as_file.port!r} holds {len(data)} images; ask for them with output_format", param="Accept"
                )
            return Response(data, media_type=as_file.media_type)
        return {
            "id": request_id,
            "object": "pipeline.run",
            "model": name,
            "outputs": {port: _port_json(port, v, formats) for port, v in outputs.items()},
        }
    return await _stream_response(request, pipeline, body, inputs, params, formats, request_id)


async def _stream_response(request, pipeline, body, inputs, params, formats, request_id) -> StreamingResponse:
    stream = pipeline.stream(inputs, params, request_id=request_id, deadline_s=body.timeout)
    # Wait for the first chunk before any byte is sent: a refusal at admission (400, 503, ...)
    # raises here and leaves with its own status instead of inside a 200 stream.
    # A failure or cancellation inside anext() finishes the generator (its own finally aborts
    # the request), so there is nothing to close here on those paths.
    try:
        first = await unless_disconnected(request, anext(stream))
    except StopAsyncIteration:
        first = None

    def event(chunk) -> bytes:
        return sse_event(
            {
                "id": request_id,
                "port": chunk.port,
                "stage": chunk.stage,
                "final": chunk.final,
                "progress": chunk.progress,
                "data": _port_json(chunk.port, chunk.data, formats),
            }
        )

    async def events():
        try:
            if first is not None:
                yield event(first)
                async for chunk in stream:
                    yield event(chunk)
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
