"""Spoken chat replies: `modalities: ["text", "audio"]` with `audio: {voice, format}` on a
pipeline whose `serves: chat` has an `audio` output role.

The chat stage gets `modalities` (it decides whether the reply is spoken); `voice` goes to the
`speech_params:` stages that declare it, and so does `seed` (a seeded spoken reply is
reproducible end to end). Not streamed, the whole waveform is encoded in the
asked format as `message.audio` {id, data, transcript, expires_at}; streamed, each audio
chunk leaves as base64 PCM16 in `delta.audio.data`, the text as `delta.audio.transcript`, and
a last audio delta carries `expires_at`. Until then a later turn may send the reply back as
`audio: {id}` (spoken_replies.py keeps its transcript).
"""

from __future__ import annotations

import base64
from typing import Any

from omnistage.serving.media import DEFAULT_SAMPLE_RATE
from omnistage.serving.routes.served import Served, UnsupportedError

FORMATS = {"wav": "wav", "pcm16": "pcm", "flac": "flac", "mp3": "mp3", "opus": "opus", "aac": "aac"}


def wants_audio(served: Served, body: Any) -> bool:
    """Whether the reply is to be spoken; refuses what the pipeline or the stream cannot give."""
    if not (body.modalities and "audio" in body.modalities):
        return False
    if served.port("audio") is None:
        raise UnsupportedError(f"the model {served.name!r} does not speak (no audio output)", param="modalities")
    if body.audio is None:
        raise UnsupportedError('modalities with "audio" need audio: {voice, format}', param="audio")
    if body.stream and body.audio.format != "pcm16":
        raise UnsupportedError("a streamed spoken reply is sent as pcm16", param="audio.format")
    return True


def audio_params(served: Served, body: Any, spoken: bool) -> dict[str, dict[str, Any]]:
    """The chat stage's `modalities` and the speech stages' `voice` (empty for text-only pipelines)."""
    if served.port("audio") is None:
        return {}
    params = served.stage_params({"modalities": ["text", "audio"] if spoken else ["text"]})
    if spoken and served.serve.speech_params:
        speech = {"voice": body.audio.voice, **({"seed": body.seed} if body.seed is not None else {})}
        for stage, values in served.stage_params(speech, served.serve.speech_params).items():
            params.setdefault(stage, {}).update(values)
    return params


def message_audio(waveform: Any, fmt: str, transcript: str, audio_id: str, expires_at: int) -> dict[str, Any]:
    from omnistage.streaming.audio import encode_audio

    data = encode_audio(waveform, DEFAULT_SAMPLE_RATE, FORMATS[fmt])
    return {
        "id": audio_id,
        "data": base64.b64encode(data).decode("ascii"),
        "transcript": transcript,
        "expires_at": expires_at,
    }


def pcm16_b64(chunk: Any) -> str:
    from omnistage.streaming.audio import to_pcm16

    return base64.b64encode(to_pcm16(chunk)).decode("ascii")
