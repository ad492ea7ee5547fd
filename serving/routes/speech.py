"""POST /v1/audio/speech on any pipeline whose YAML `serves: speech` (roles `input`, a text or
json input port, and `audio`, the waveform output; tiny-omni's thinker says the input exactly).

`voice` (and the extra field `seed`) go to the `speech_params:` stages that declare them, a
voice the model lacks is a 400 from the stage naming `voice`. The answer is sent as the audio
is made (chunked transfer; speech_audio.py: pcm, wav, mp3, opus and aac as they are made,
flac once complete), or with `stream_format: "sse"` as `speech.audio.delta` events carrying base64
PCM16 and a closing `speech.audio.done` with usage (OpenAI's {input_tokens, output_tokens,
total_tokens}: every text token the text stage read, from the `info` role, and the codec
tokens of the `speech_info` role). `speed` (0.25-4) changes the tempo and keeps the pitch.
`instructions` go to the `instructions` role's port (a json port gets them as a user turn the
spoken text answers); a pipeline without that role refuses them (400 naming the field), as it
does a voice object other than `{"id": name}`.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from omnistage.serving.deps import unless_disconnected
from omnistage.serving.media import DEFAULT_SAMPLE_RATE
from omnistage.serving.routes.request_base import OpenAIRequest
from omnistage.serving.routes.served import Served, UnsupportedError, new_id, served_pipeline
from omnistage.serving.routes.speech_audio import SpeechEncoder
from omnistage.serving.routes.streams import one_per_batch, sse_stream
from omnistage.streaming.audio import AUDIO_MEDIA_TYPES

router = APIRouter(tags=["openai"])

MAX_INPUT_CHARS = 4096  # OpenAI's limit


class VoiceId(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str


class SpeechRequest(OpenAIRequest):
    model: str
    input: str = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    voice: str | VoiceId = Field(description="a voice of the model (tiny-omni: Chelsie, Ethan)")
    instructions: str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["sse", "audio"] = "audio"
    # extra
    seed: int | None = Field(default=None, description="seed of the speech stages (same seed, same audio)")

    @field_validator("input")
    @classmethod
    def _some_text(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("input has nothing to say: it is only whitespace")
        return value

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceId) else self.voice


def _params(served: Served, body: SpeechRequest) -> dict[str, dict[str, Any]]:
    fields = {"voice": body.voice_name, **({"seed": body.seed} if body.seed is not None else {})}
    stages = list(dict.fromkeys([*served.serve.speech_params, *served.serve.params]))
    return served.stage_params(fields, stages)


@router.post(
    "/v1/audio/speech",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {
                **{media: {} for media in dict.fromkeys(AUDIO_MEDIA_TYPES.values())},
                "text/event-stream": {},
            }
        }
    },
)
async def create_speech(body: SpeechRequest, request: Request):
    served = served_pipeline(request, body.model, "speech")
    if body.stream_format == "sse" and body.response_format != "pcm":
        raise UnsupportedError('stream_format "sse" sends base64 PCM16: use response_format "pcm"', "response_format")
    params = _params(served, body)
    stream = served.pipeline.stream(_inputs(served, body), params, request_id=new_id("speech"))
    audio_port = served.port("audio")
    rest = await _from_first_audio(request, stream, audio_port)
    encoder = SpeechEncoder(body.response_format, DEFAULT_SAMPLE_RATE, body.speed)
    infos: dict[str, Any] = {}

    async def audio_bytes():
        async for item in rest:
            if item.port == audio_port and item.data is not None and len(item.data):
                data = encoder.feed(item.data)
                if data:
                    yield data
            elif item.port != audio_port and item.data is not None:
                infos[item.port] = item.data
        yield encoder.finish()

    if body.stream_format == "sse":
        events = _sse_events(audio_bytes(), lambda: _usage(served, infos))
        return sse_stream(one_per_batch(events), stream, done=False)

    async def body_bytes():
        try:
            async for data in audio_bytes():
                if data:
                    yield data
        finally:
            await stream.aclose()

    return StreamingResponse(body_bytes(), media_type=AUDIO_MEDIA_TYPES[body.response_format])


async def _from_first_audio(request: Request, stream, audio_port: str):
    """Waits for the first audio chunk (a refusal by any stage, such as an unknown voice at the
    talker, raises here with its HTTP status); returns an iterator over everything from the start."""
    held: list[Any] = []

    async def until_audio() -> None:
        async for item in stream:
            held.append(item)
            if item.port == audio_port and item.data is not None and len(item.data):
                return

    try:
        await unless_disconnected(request, until_audio())
    except BaseException:
        await stream.aclose()
        raise

    async def chained():
        for item in held:
            yield item
        async for item in stream:
            yield item

    return chained()


def _inputs(served: Served, body: SpeechRequest) -> dict[str, Any]:
    inputs: dict[str, Any] = {served.port("input"): body.input}
    if body.instructions:
        port = served.port("instructions")
        if port is None:
            raise UnsupportedError(f"the model {served.name!r} takes no instructions", "instructions")
        json_port = served.spec.inputs[port] == "json"
        inputs[port] = [{"role": "user", "content": body.instructions}] if json_port else body.instructions
    return inputs


def _usage(served: Served, infos: dict[str, Any]) -> dict[str, int] | None:
    """OpenAI's speech usage: input tokens are every text token the text stage read (its
    prompt and the forced reply, the input text), output tokens the speech stages' codec tokens."""
    info_port, speech_port = served.port("info"), served.port("speech_info")
    if info_port is None and speech_port is None:
        return None
    text = (infos.get(info_port) or {}).get("usage") or {}
    read = int(text.get("prompt_tokens", 0)) + int(text.get("completion_tokens", 0))
    codes = int(((infos.get(speech_port) or {}).get("usage") or {}).get("codec_tokens", 0))
    return {"input_tokens": read, "output_tokens": codes, "total_tokens": read + codes}


async def _sse_events(chunks, usage):
    async for data in chunks:
        if data:
            yield {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}
    done = {"type": "speech.audio.done"}
    if (counted := usage()) is not None:  # a pipeline without info roles has nothing to count
        done["usage"] = counted
    yield done
