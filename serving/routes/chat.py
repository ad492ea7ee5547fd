"""POST /v1/chat/completions on any pipeline whose YAML `serves: chat`.

The request's messages go to the `messages` role's input port (the stage applies the model's
chat template); sampling fields go to the `params:` stages that declare them; the reply is the
`text` role's output port (streamed as `chat.completion.chunk` events) and finish reason,
usage and logprobs come from the `info` role's port. With n > 1 the first sequence streams as
it is made and the others arrive whole at the end (the AR stage streams sequence 0 only).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from omnistage.serving.apidocs import inline_schema
from omnistage.serving.deps import unless_disconnected
from omnistage.serving.routes.chat_audio import audio_params, message_audio, pcm16_b64, wants_audio
from omnistage.serving.routes.chat_input import pipeline_inputs
from omnistage.serving.routes.chat_models import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest
from omnistage.serving.routes.served import Served, UnsupportedError, new_id, now, served_pipeline
from omnistage.serving.routes.spoken_replies import remember_reply, transcripts_for
from omnistage.serving.routes.streams import TEXT_SLOT, TextDelta, first_then_rest, spliced_encoder, sse_stream
from omnistage.serving.routes.textgen import (
    chat_logprobs,
    check_stream_options,
    choices_of,
    finish_reason,
    tokenizer_for,
    usage,
)
from omnistage.serving.tenancy import salt_by_key

router = APIRouter(tags=["openai"])


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise UnsupportedError("tools (function calling) are not supported yet", param="tools")
    if body.tool_choice not in (None, "none"):
        raise UnsupportedError("tool_choice is not supported yet (no tools)", param="tool_choice")
    if body.response_format is not None and body.response_format.get("type") not in (None, "text"):
        raise UnsupportedError("response_format other than text is not supported yet", param="response_format")
    if body.logit_bias:
        raise UnsupportedError("logit_bias is not supported yet", param="logit_bias")
    if body.top_logprobs is not None and not body.logprobs:
        raise UnsupportedError("top_logprobs needs logprobs: true", param="top_logprobs")
    check_stream_options(body)


def _stage_params(served: Served, body: ChatCompletionRequest, spoken: bool) -> dict[str, dict[str, Any]]:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    fields = body.sampling_fields(max_tokens, top)
    if body.mm_processor_kwargs is not None and body.mm_processor_kwargs.use_audio_in_video:
        fields["use_audio_in_video"] = True  # refused, naming it, where no params stage takes it
    params = served.stage_params(fields)
    for stage, values in audio_params(served, body, spoken).items():
        params.setdefault(stage, {}).update(values)
    return params


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={200: {"content": {"text/event-stream": {"schema": inline_schema(ChatCompletionChunk)}}}},
)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    served = served_pipeline(request, body.model, "chat")
    _check_unsupported(body)
    spoken = wants_audio(served, body)
    transcripts = transcripts_for(request)
    if any(isinstance(m.content, list) for m in body.messages):  # media checks decode: off the loop
        in_video = body.mm_processor_kwargs is not None and body.mm_processor_kwargs.use_audio_in_video
        inputs = await run_in_threadpool(pipeline_inputs, served, body.messages, in_video, transcripts)
    else:  # plain text: no thread hop before the first token
        inputs = pipeline_inputs(served, body.messages, transcripts=transcripts)
    params = salt_by_key(request, served, _stage_params(served, body, spoken))
    tokenizer = tokenizer_for(served) if body.logprobs else None
    request_id = new_id("chatcmpl")
    if body.stream:
        return await _stream(request, served, body, inputs, params, request_id, tokenizer, spoken)
    outputs = await unless_disconnected(request, served.pipeline.generate(inputs, params, request_id=request_id))
    info = outputs.get(served.port("info")) if served.port("info") else None
    choices = []
    for c in choices_of(outputs.get(served.port("text")) or "", info, body.n):
        logprobs = chat_logprobs(tokenizer, c.get("logprobs") or []) if tokenizer is not None else None
        message = {"role": "assistant", "content": c["text"], "refusal": None}
        if spoken and c["index"] == 0:  # the speech stages speak sequence 0
            message["content"] = None
            audio_id = new_id("audio")
            expires_at = remember_reply(request, audio_id, c["text"])
            waveform = outputs[served.port("audio")]
            message["audio"] = message_audio(waveform, body.audio.format, c["text"], audio_id, expires_at)
        choices.append(
            {
                "index": c["index"],
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason(c["finish_reason"]),
            }
        )
    return JSONResponse(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": served.name,
            "choices": choices,
            "usage": usage(info, _speech_info(served, outputs) if spoken else None),
            "system_fingerprint": None,
        }
    )


def _speech_info(served: Served, outputs: dict[str, Any]) -> dict[str, Any] | None:
    port = served.port("speech_info")
    return (outputs.get(port) or {}) if port is not None else None


async def _stream(request, served: Served, body, inputs, params, request_id, tokenizer, spoken) -> StreamingResponse:
    stream = served.pipeline.stream_batches(inputs, params, request_id=request_id)
    first = await first_then_rest(request, stream)
    created, text_port, info_port, audio_port = now(), served.port("text"), served.port("info"), served.port("audio")
    speech_info_port = served.port("speech_info") if spoken else None
    audio_id, transcript = new_id("audio"), []

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": served.name,
            "choices": choices,
            **extra,
        }

    content_event = spliced_encoder(
        chunk([{"index": 0, "delta": {"content": TEXT_SLOT}, "logprobs": None, "finish_reason": None}])
    )
    ends: dict[str, Any] = {"info": None, "speech_info": {} if speech_info_port is not None else None}

    def delta(item) -> Any:
        """The event of one chunk (None: no event; its info is kept for the end)."""
        if item.port == text_port and item.data and not spoken:
            return TextDelta(item.data, content_event)  # merged with its neighbours in the batch
        if item.port == text_port and item.data:
            transcript.append(item.data)
            audio = {"audio": {"id": audio_id, "transcript": item.data}}
            return chunk([{"index": 0, "delta": audio, "logprobs": None, "finish_reason": None}])
        if spoken and item.port == audio_port and item.data is not None and len(item.data):
            audio = {"audio": {"id": audio_id, "data": pcm16_b64(item.data)}}
            return chunk([{"index": 0, "delta": audio, "logprobs": None, "finish_reason": None}])
        if item.port == info_port and item.data is not None:
            ends["info"] = item.data
        elif item.port == speech_info_port and item.data is not None:
            ends["speech_info"] = item.data
        return None

    async def events():
        head = [chunk([{"index": i, "delta": {"role": "assistant", "content": ""}} for i in range(body.n)])]
        async for batch in first:
            out, head = head, []
            out.extend(e for e in map(delta, batch) if e is not None)
            if out:
                yield out
        tail = []
        if spoken:  # the reply is whole: from now on a later turn may send it back by id
            expires_at = remember_reply(request, audio_id, "".join(transcript))
            audio = {"audio": {"id": audio_id, "expires_at": expires_at}}
            tail.append(chunk([{"index": 0, "delta": audio, "logprobs": None, "finish_reason": None}]))
        for c in choices_of("", ends["info"], body.n):
            rest = c["text"] if c["index"] > 0 and c.get("text") else None
            logprobs = chat_logprobs(tokenizer, c.get("logprobs") or []) if tokenizer is not None else None
            reason = finish_reason(c["finish_reason"])
            final = {"content": rest} if rest else {}
            tail.append(chunk([{"index": c["index"], "delta": final, "logprobs": logprobs, "finish_reason": reason}]))
        if body.include_usage:
            tail.append(chunk([], usage=usage(ends["info"], ends["speech_info"])))
        yield head + tail

    return sse_stream(events(), stream)
