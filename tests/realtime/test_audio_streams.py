"""Audio streams of a realtime session against whole-clip judges: the server VAD's batched
forwards against silero's own model wrapper, and packets resampled as they arrive (input,
VAD, answer deltas) against torchaudio resampling the whole clip."""

from __future__ import annotations

import asyncio
import base64
import json
import types

import numpy as np
import pytest
import torch
import torchaudio.functional as AF

from omnistage.serving.realtime.audio import AudioFormat, StreamResampler
from omnistage.serving.realtime.session import RealtimeSession
from omnistage.serving.realtime.vad import FRAME, VAD_RATE, VadStream, run_samples
from omnistage.tests.realtime.conftest import RATE, silence, speech


def _reference_probabilities(samples_24k: np.ndarray) -> np.ndarray:
    """silero-vad's TorchScript model through its own wrapper (state and context kept by it),
    frame by frame, on the same 16 kHz audio."""
    from silero_vad import load_silero_vad

    model = load_silero_vad(onnx=False)
    audio = AF.resample(torch.from_numpy(samples_24k.astype(np.float32) / 32768), RATE, VAD_RATE)
    frames = audio[: len(audio) // FRAME * FRAME].view(-1, FRAME)
    with torch.inference_mode():
        return np.array([float(model(f, VAD_RATE)) for f in frames])


def test_batched_sessions_get_silero_probabilities():
    """Three sessions with different audio, appended in packets of different sizes and run
    in shared batches: each gets the probabilities silero's own wrapper gives its audio."""
    clips = [
        np.concatenate([silence(0.4), speech(), silence(0.6)]),
        np.concatenate([speech(), silence(1.0)]),
        np.concatenate([silence(1.5), speech()[: RATE // 2], silence(0.5)]),
    ]
    packets = [480, 960, 1234]  # 20 ms, 40 ms, and a size that splits frames
    streams = [VadStream() for _ in clips]
    got: list[list[float]] = [[] for _ in clips]
    offsets = [0, 0, 0]
    while any(o < len(c) for o, c in zip(offsets, clips)):
        jobs, who = [], []
        for i, clip in enumerate(clips):
            if offsets[i] < len(clip):
                chunk = clip[offsets[i] : offsets[i] + packets[i]].astype(np.float32) / 32768
                offsets[i] += packets[i]
                jobs.append((streams[i], chunk))
                who.append(i)
        for i, probs in zip(who, run_samples(jobs)):
            got[i].extend(probs.tolist())
    for i, clip in enumerate(clips):
        ref = _reference_probabilities(clip)
        ours = np.array(got[i])
        assert len(ours) == len(ref), (i, len(ours), len(ref))
        assert np.abs(ours - ref).max() < 1e-4, (i, np.abs(ours - ref).max())
        assert (ref >= 0.5).any() and (ref < 0.35).any()  # the audio has speech and silence


def _whole(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    return AF.resample(torch.from_numpy(np.asarray(samples, dtype=np.float32)), rate, target).numpy()


@pytest.mark.parametrize(
    "rate,target", [(24_000, 16_000), (8_000, 24_000), (16_000, 24_000), (44_100, 24_000), (24_000, 8_000)]
)
def test_packets_resampled_as_they_come_equal_the_clip_resampled_whole(rate, target):
    rng = np.random.default_rng(rate + target)
    clip = (rng.standard_normal(rate // 2 + 37) * 0.3).astype(np.float32)
    resampler, out, at = StreamResampler(rate, target), [], 0
    while at < len(clip):
        size = int(rng.integers(1, rate // 25))  # up to 40 ms, often not a whole kernel block
        out.append(resampler.push(clip[at : at + size]))
        at += size
    out.append(resampler.flush())
    streamed, whole = np.concatenate(out), _whole(clip, rate, target)
    assert streamed.shape == whole.shape
    np.testing.assert_allclose(streamed, whole, atol=1e-5)


def _packets(samples: np.ndarray, size: int) -> list[np.ndarray]:
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def test_appended_packets_commit_the_clip_resampled_whole():
    """audio/pcm at 16 kHz in 20 ms appends, committed by hand: the user item holds the clip
    resampled to 24 kHz as one piece (resampling each packet alone would pad both its edges)."""
    clip16k = (_whole(speech()[: RATE // 2].astype(np.float32) / 32768, RATE, 16_000) * 32767).round().astype("<i2")
    fmt = {"type": "audio/pcm", "rate": 16_000}
    sent: list[dict] = []

    async def collect(event: dict) -> None:
        sent.append(event)

    async def main():
        session = RealtimeSession(served=types.SimpleNamespace(name="tiny-omni"), send=collect, vad=None)
        update = {"type": "realtime", "audio": {"input": {"turn_detection": None, "format": fmt}}}
        await session.handle(json.dumps({"type": "session.update", "session": update}))
        for packet in _packets(clip16k, 320):
            audio = base64.b64encode(packet.tobytes()).decode()
            await session.handle(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
        await session.handle(json.dumps({"type": "input_audio_buffer.commit"}))
        return session.conversation.items[-1].content[0].samples

    committed = asyncio.run(main())
    assert [e["type"] for e in sent if e["type"] == "error"] == [], sent
    want = _whole(clip16k.astype(np.float32) / 32768, 16_000, RATE)
    assert committed.shape == want.shape
    np.testing.assert_allclose(committed, want, atol=1e-5)


def test_answer_deltas_at_another_rate_are_the_answer_resampled_whole(monkeypatch):
    """An answer streamed in pipeline-sized chunks to an audio/pcm 16 kHz client: its deltas
    joined are the whole answer resampled once (to pcm16 rounding), none empty."""
    from omnistage.serving.realtime.conversation import Item
    from omnistage.serving.realtime.response import ResponsePlan, ResponseRunner

    rng = np.random.default_rng(7)
    answer = (rng.standard_normal(RATE) * 0.2).astype(np.float32)  # 1 s at 24 kHz
    chunks = _packets(answer, 1_920)  # 80 ms, the size token2wav hands out

    async def speak(self, ids):
        for chunk in chunks:
            await self._audio_delta(ids, chunk)

    monkeypatch.setattr(ResponseRunner, "_stream", speak)
    out_format = AudioFormat("audio/pcm", 16_000)
    plan = ResponsePlan(True, out_format, None, None, None, "salt")
    sent: list[dict] = []

    async def collect(event: dict) -> None:
        sent.append(event)

    asyncio.run(ResponseRunner(None, plan, Item("assistant"), collect).run())
    deltas = [base64.b64decode(e["delta"]) for e in sent if e["type"] == "response.output_audio.delta"]
    assert deltas and all(deltas)
    got = np.frombuffer(b"".join(deltas), dtype="<i2").astype(np.int32)
    want = np.frombuffer(out_format.from_samples(_whole(answer, RATE, 16_000)), dtype="<i2").astype(np.int32)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1
