"""POST /v1/audio/speech on any pipeline whose YAML `serves: speech` (roles `input`, a text or
json input port, and `audio`, the waveform output; tiny-omni's thinker says the input exactly).

`voice` (and the extra field `seed`) go to the `speech_params:` stages that declare them, a
voice the model lacks is a 400 from the stage naming `voice`. The answer is sent as the audio
is made (chunked transfer; speech_audio.py: pcm, wav, mp3, opus and aac as they are made,
flac once complete), or with `stream_format: "sse"` as `speech.audio.delta` events carrying base64
PCM16 and a closing `speech.audio.done` with usage. `speed` (0.25-4) changes the tempo and
keeps the pitch. Not served (400 naming the field): `instructions` (no voice direction in
these models), a voice object other than `{"id": name}`.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from omnistage.serving.deps import unless_disconnected
from omnistage.serving.media import DEFAULT_SAMPLE_RATE
from omnistage.serving.routes.served import Served, UnsupportedError, new_id, served_pipeline
from omnistage.serving.routes.speech_audio import SpeechEncoder
from omnistage.serving.routes.streams import sse_stream
from omnistage.streaming.audio import AUDIO_MEDIA_TYPES

router = APIRouter(tags=["openai"])

MAX_INPUT_CHARS = 4096  # OpenAI's limit


class VoiceId(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    voice: str | VoiceId = Field(description="a voice of the model (tiny-omni: Chelsie, Ethan)")
    instructions: str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["sse", "audio"] = "audio"
    # extra
    seed: int | None = Field(default=None, description="seed of the speech stages (same seed, same audio)")

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
    if body.instructions:
        raise UnsupportedError("instructions are not supported by this model (no voice direction)", "instructions")
    if body.stream_format == "sse" and body.response_format != "pcm":
        raise UnsupportedError('stream_format "sse" sends base64 PCM16: use response_format "pcm"', "response_format")
    params = _params(served, body)
    stream = served.pipeline.stream({served.port("input"): body.input}, params, request_id=new_id("speech"))
    audio_port = served.port("audio")
    rest = await _from_first_audio(request, stream, audio_port)
    encoder = SpeechEncoder(body.response_format, DEFAULT_SAMPLE_RATE, body.speed)

    async def audio_bytes():
        async for item in rest:
            if item.port == audio_port and item.data is not None and len(item.data):
                data = encoder.feed(item.data)
                if data:
                    yield data
        yield encoder.finish()

    if body.stream_format == "sse":
        return sse_stream(_sse_events(audio_bytes()), stream, done=False)

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


async def _sse_events(chunks):
    async for data in chunks:
        if data:
            yield {"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")}
    yield {"type": "speech.audio.done"}  # no usage: the speech family has no info role
