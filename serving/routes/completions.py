"""POST /v1/completions (OpenAI's legacy text completions) on pipelines that `serves: completions`.

`prompt` is one string (a list of one string is accepted); `echo`, `best_of` > n and `suffix`
are refused with a 400 naming the field. Sampling, stop, seed, n, logprobs and streaming work
as in chat (serving/routes/chat.py).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from omnistage.errors import InvalidRequestError
from omnistage.serving.apidocs import inline_schema
from omnistage.serving.deps import unless_disconnected
from omnistage.serving.routes.chat_models import Usage
from omnistage.serving.routes.served import Served, UnsupportedError, new_id, now, served_pipeline
from omnistage.serving.routes.streams import TEXT_SLOT, TextDelta, first_then_rest, spliced_encoder, sse_stream
from omnistage.serving.routes.textgen import (
    SamplingFields,
    check_stream_options,
    choices_of,
    completion_logprobs,
    finish_reason,
    tokenizer_for,
    usage,
)
from omnistage.serving.tenancy import salt_by_key

router = APIRouter(tags=["openai"])


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    logit_bias: dict[str, float] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "content_filter"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def _prompt(body: CompletionRequest) -> str:
    if isinstance(body.prompt, str):
        prompt = body.prompt
    elif len(body.prompt) != 1:
        raise UnsupportedError("prompt: one prompt per request (send several requests)", param="prompt")
    else:
        prompt = body.prompt[0]
    if not prompt:
        raise InvalidRequestError("prompt: the prompt is empty", param="prompt")
    return prompt


def _check(body: CompletionRequest) -> None:
    if body.echo:
        raise UnsupportedError("echo is not supported", param="echo")
    if body.best_of not in (None, body.n):
        raise UnsupportedError("best_of other than n is not supported", param="best_of")
    if body.suffix:
        raise UnsupportedError("suffix is not supported", param="suffix")
    if body.logit_bias:
        raise UnsupportedError("logit_bias is not supported yet", param="logit_bias")
    check_stream_options(body)


@router.post(
    "/v1/completions",
    response_model=Completion,
    responses={200: {"content": {"text/event-stream": {"schema": inline_schema(Completion)}}}},
)
async def completions(body: CompletionRequest, request: Request):
    served = served_pipeline(request, body.model, "completions")
    _check(body)
    inputs = {served.port("prompt"): _prompt(body)}
    params = salt_by_key(request, served, served.stage_params(body.sampling_fields(body.max_tokens, body.logprobs)))
    tokenizer = tokenizer_for(served) if body.logprobs is not None else None
    request_id = new_id("cmpl")
    if body.stream:
        return await _stream(request, served, body, inputs, params, request_id, tokenizer)
    outputs = await unless_disconnected(request, served.pipeline.generate(inputs, params, request_id=request_id))
    info = outputs.get(served.port("info")) if served.port("info") else None
    choices = [
        _choice(c["index"], c["text"], c, tokenizer, finish_reason(c["finish_reason"]))
        for c in choices_of(outputs.get(served.port("text")) or "", info, body.n)
    ]
    return JSONResponse(
        {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": served.name,
            "choices": choices,
            "usage": usage(info),
        }
    )


def _choice(index: int, text: str, c: dict[str, Any], tokenizer: Any, reason: str | None) -> dict[str, Any]:
    logprobs = completion_logprobs(tokenizer, c.get("logprobs") or []) if tokenizer is not None else None
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


async def _stream(request, served: Served, body, inputs, params, request_id, tokenizer) -> StreamingResponse:
    stream = served.pipeline.stream_batches(inputs, params, request_id=request_id)
    first = await first_then_rest(request, stream)
    created, text_port, info_port = now(), served.port("text"), served.port("info")

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        base = {"id": request_id, "object": "text_completion", "created": created, "model": served.name}
        return {**base, "choices": choices, **extra}

    text_event = spliced_encoder(chunk([{"index": 0, "text": TEXT_SLOT, "logprobs": None, "finish_reason": None}]))

    async def events():
        info = None
        async for batch in first:
            out = []
            for item in batch:
                if item.port == text_port and item.data:
                    out.append(TextDelta(item.data, text_event))  # merged with its neighbours in the batch
                elif item.port == info_port and item.data is not None:
                    info = item.data
            if out:
                yield out
        tail = []
        for c in choices_of("", info, body.n):
            rest = c["text"] if c["index"] > 0 and c.get("text") else ""
            tail.append(chunk([_choice(c["index"], rest, c, tokenizer, finish_reason(c["finish_reason"]))]))
        if body.include_usage:
            tail.append(chunk([], usage=usage(info)))
        yield tail

    return sse_stream(events(), stream)
