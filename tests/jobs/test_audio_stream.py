"""WS /v1/jobs/{id}/stream on an audio pipeline (tiny-omni's speech): PCM16 chunks arrive as the
vocoder emits them, before the job completes, and reassembled they are the finished WAV's samples."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf
import websockets

from omnistage.tests.jobs.conftest import wait_status

SPEECH_JOB = {
    "model": "tiny-omni",
    "inputs": {"messages": [{"role": "user", "content": [{"type": "text", "text": "Say something."}]}]},
    "params": {
        "thinker": {"temperature": 0, "max_tokens": 24, "ignore_eos": True, "return_audio": True},
        "talker": {"temperature": 0, "max_tokens": 96, "voice": "Ethan"},
        "token2wav": {"voice": "Ethan", "seed": 0},
    },
}


async def _watch(url: str) -> tuple[list[bytes], list[dict], int | None]:
    """(binary frames, events, how many binary frames came before the completed event)."""
    frames, events, before_completed = [], [], None
    async with websockets.connect(url, max_size=None) as ws:
        async for message in ws:
            if isinstance(message, bytes):
                frames.append(message)
            else:
                event = json.loads(message)
                events.append(event)
                if event["type"] == "completed":
                    before_completed = len(frames)
    return frames, events, before_completed


@pytest.mark.parametrize("fmt", ["wav", "pcm"])
def test_speech_streams_as_pcm16_chunks_equal_to_the_finished_file(omni_server, fmt):
    with httpx.Client(base_url=omni_server.url, timeout=60) as client:
        created = client.post("/v1/jobs", json={**SPEECH_JOB, "output_format": {"audio": fmt}})
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
        ws_url = omni_server.url.replace("http", "ws") + f"/v1/jobs/{job_id}/stream"
        frames, events, before_completed = asyncio.run(_watch(ws_url))
        done = wait_status(client, job_id, ("completed", "failed"))
        assert done["status"] == "completed", done
        (file,) = done["outputs"]["audio"]["files"]
        finished = client.get(file["url"]).content
    assert len(frames) >= 2 and before_completed == len(frames)  # chunks, all before `completed`
    assert [e["type"] for e in events][-1] == "completed"
    streamed = b"".join(frames)
    if fmt == "wav":
        got, rate = sf.read(io.BytesIO(streamed), dtype="int16")  # a WAV of unknown length
        want, want_rate = sf.read(io.BytesIO(finished), dtype="int16")
        assert rate == want_rate == 24000
    else:
        got, want = np.frombuffer(streamed, "<i2"), np.frombuffer(finished, "<i2")
    assert want.size > 2400 and np.array_equal(got.reshape(-1), want.reshape(-1))


@pytest.mark.parametrize("chunks", [[], [np.zeros(0, np.float32)], [np.full(480, 0.25, np.float32)] * 2])
def test_a_wav_stream_is_one_wav_even_without_audio(chunks):
    """A talker may end at its first step: the listener still gets a WAV (the header, no
    samples); with audio, finishing adds nothing to the stream."""
    from omnistage.serving.jobs.live import LiveAudio

    live = LiveAudio("audio", 24000, "wav")
    for chunk in chunks:
        live.push(chunk)
    live.finish()
    samples, rate = sf.read(io.BytesIO(b"".join(live.segments)), dtype="int16")
    expected = np.concatenate([*chunks, np.zeros(0, np.float32)])
    assert rate == 24000 and len(samples) == len(expected)
    np.testing.assert_array_equal(samples, np.round(expected * 32767).astype(np.int16))
