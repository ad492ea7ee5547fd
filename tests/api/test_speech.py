"""POST /v1/audio/speech on tiny-omni (serves: speech) through the official `openai` client:
every format decodes (soundfile for wav/flac/pcm, PyAV for mp3/opus/aac) to the Python API's
waveform for the same text, voice and seed; chunked and SSE streaming arrive in pieces;
speed changes the duration and keeps the pitch; refusals name their field."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import soundfile

from omnistage.streaming.audio import to_pcm16_array

TEXT = "Good evening, and welcome."
SEED = 3
SR = 24_000


SPEECH_PARAMS = {"talker": {"voice": "Chelsie", "seed": SEED}, "token2wav": {"seed": SEED}}


@pytest.fixture(scope="module")
def python_run(omni_pipeline) -> dict:
    return omni_pipeline.run({"speak": TEXT}, SPEECH_PARAMS, timeout=300)


@pytest.fixture(scope="module")
def python_speech(python_run) -> np.ndarray:
    audio = np.asarray(python_run["audio"], dtype=np.float32).reshape(-1)
    assert audio.size > 0
    return audio


def _speech(omni, fmt: str, **extra) -> bytes:
    reply = omni.audio.speech.create(
        model="tiny-omni", voice="Chelsie", input=TEXT, response_format=fmt, extra_body={"seed": SEED, **extra}
    )
    return reply.content


def _pyav_decode(data: bytes) -> tuple[np.ndarray, int]:
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
        return np.concatenate(frames).astype(np.float32), stream.rate


@pytest.mark.parametrize("fmt", ["wav", "flac", "pcm"])
def test_lossless_formats_are_the_python_apis_pcm16(omni, python_speech, fmt):
    data = _speech(omni, fmt)
    if fmt == "pcm":
        samples, rate = np.frombuffer(data, dtype="<i2"), SR
    else:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == SR
    # bit for bit: the Python API's float waveform quantized to PCM16 the same way
    assert np.array_equal(samples.reshape(-1), to_pcm16_array(python_speech).reshape(-1))


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac"])
def test_compressed_formats_decode_to_the_same_length(omni, python_speech, fmt):
    samples, rate = _pyav_decode(_speech(omni, fmt))
    expected = python_speech.size * rate / SR
    # codec priming and frame padding add at most a few frames
    assert expected <= samples.size <= expected + 4096, (samples.size, expected)


@pytest.mark.parametrize(("fmt", "media_type"), [("pcm", "audio/pcm"), ("mp3", "audio/mpeg")])
def test_chunked_response_streams_the_same_bytes(omni, python_speech, fmt, media_type):
    whole = _speech(omni, fmt)
    with omni.audio.speech.with_streaming_response.create(
        model="tiny-omni", voice="Chelsie", input=TEXT, response_format=fmt, extra_body={"seed": SEED}
    ) as response:
        assert response.headers["content-type"] == media_type
        pieces = [p for p in response.iter_bytes() if p]
    assert b"".join(pieces) == whole
    assert len(pieces) >= 2, len(pieces)  # sent as it was made, not one clip at the end


def _text_tokens_read(text: str, instructions: str | None = None) -> int:
    """Tokens the thinker reads to say `text`: the chat template of the speech system prompt
    and the user turn (the text itself, or the instructions), then the text as the reply; by
    the checkpoint's own tokenizer and template."""
    from transformers import AutoTokenizer

    from omnistage.models.recipes import build_recipe
    from omnistage.stages.omni.inputs import SPEECH_SYSTEM_PROMPT

    tok = AutoTokenizer.from_pretrained(build_recipe("qwen2_5_omni"))
    turns = [{"role": "system", "content": SPEECH_SYSTEM_PROMPT}, {"role": "user", "content": instructions or text}]
    prompt = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return len(tok(prompt, add_special_tokens=False)["input_ids"]) + len(
        tok(text, add_special_tokens=False)["input_ids"]
    )


def test_sse_sends_speech_audio_delta_events_and_usage(omni, python_run):
    events = []
    with omni.audio.speech.with_streaming_response.create(
        model="tiny-omni",
        voice="Chelsie",
        input=TEXT,
        response_format="pcm",
        stream_format="sse",
        extra_body={"seed": SEED},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and len(events) >= 3
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert pcm == _speech(omni, "pcm")
    codes = len(list(python_run["codes"]))
    read = _text_tokens_read(TEXT)
    assert events[-1]["usage"] == {"input_tokens": read, "output_tokens": codes, "total_tokens": read + codes}
    assert codes > 0


def test_instructions_are_the_turn_the_speech_answers(omni, omni_pipeline, python_speech):
    """`instructions` reach the thinker as the user turn the forced reply answers: the talker
    hears its hidden states, so they condition the speech (bit for bit the Python API's)."""
    instructions = "Speak slowly, in a calm and warm voice."
    reply = omni.audio.speech.create(
        model="tiny-omni",
        voice="Chelsie",
        input=TEXT,
        instructions=instructions,
        response_format="pcm",
        extra_body={"seed": SEED},
    )
    ours = np.frombuffer(reply.content, dtype="<i2")
    messages = [{"role": "user", "content": instructions}]
    ref = omni_pipeline.run({"speak": TEXT, "messages": messages}, SPEECH_PARAMS, timeout=300)
    assert np.array_equal(ours, to_pcm16_array(np.asarray(ref["audio"], dtype=np.float32)).reshape(-1))
    plain = to_pcm16_array(python_speech).reshape(-1)
    assert ours.shape != plain.shape or not np.array_equal(ours, plain)  # they changed the speech


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_changes_duration_not_pitch(omni, python_speech, speed):
    samples = np.frombuffer(_speech(omni, "pcm", speed=speed), dtype="<i2").astype(np.float32)
    assert abs(samples.size - python_speech.size / speed) <= 0.05 * python_speech.size / speed

    def peak_hz(x: np.ndarray) -> float:
        return float(np.abs(np.fft.rfft(x)).argmax() * SR / x.size)

    original = to_pcm16_array(python_speech).reshape(-1).astype(np.float32)
    assert abs(peak_hz(samples) - peak_hz(original)) <= 0.05 * peak_hz(original) + 20


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"stream_format": "sse", "response_format": "mp3"}, 400, "response_format"),
        ({"voice": "alloy"}, 400, "voice"),
        ({"model": "tiny-nope"}, 404, "model"),  # not on this server
        ({"model": "tiny-llm"}, 400, "model"),  # served, but not a speech model
        ({"speed": 5}, 400, "speed"),
        ({"input": "x" * 4097}, 400, "input"),
        ({"input": "  \n "}, 400, "input"),  # nothing to say (the thinker's port is not the field)
        ({"input": "ab, cd. " * 511}, 400, "input"),  # within 4096 characters, past the context
    ],
)
def test_refusals_name_the_field(omni_server, extra, status, param):
    body = {"model": "tiny-omni", "voice": "Chelsie", "input": TEXT, **extra}
    r = httpx.post(omni_server.url + "/v1/audio/speech", json=body, timeout=300)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()
    with pytest.raises(openai.APIStatusError):
        openai.OpenAI(base_url=omni_server.url + "/v1", api_key="x", max_retries=0).audio.speech.create(**body)
