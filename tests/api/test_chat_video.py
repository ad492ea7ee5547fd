"""Chat with video_url parts on tiny-omni through the official `openai` client against a live
server, judged by the Python API fed the same MP4 and the frames PyAV decodes from it."""

from __future__ import annotations

import base64
import io
from fractions import Fraction

import av
import numpy as np
import openai
import pytest


def encode_mp4(frames, fps: int = 4, pts=None) -> bytes:
    """H.264 MP4 of [N, H, W, 3] uint8 frames; `pts` in 1/fps units (default 0, 1, 2, ...)."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"preset": "ultrafast"})
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps)
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")
            frame.pts = i if pts is None else pts[i]
            frame.time_base = Fraction(1, fps)
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def smooth_frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    blocks = (np.random.RandomState(seed).rand(n, h // 8, w // 8, 3) * 255).astype(np.uint8)
    return np.repeat(np.repeat(blocks, 8, axis=1), 8, axis=2)


VIDEO = encode_mp4(smooth_frames(8, 56, 88, 3), fps=4)  # 2 s: 4 frames sampled at 2 frames/s


def video_message(raw: bytes, text: str = "What happens?") -> list[dict]:
    url = "data:video/mp4;base64," + base64.b64encode(raw).decode()
    return [
        {
            "role": "user",
            "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}],
        }
    ]


PY_MESSAGES = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
GREEDY = {"thinker": {"temperature": 0.0, "max_tokens": 8, "modalities": ["text"]}}


def pyav_frames(raw: bytes) -> dict:
    with av.open(io.BytesIO(raw)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return {"frames": np.stack(frames), "fps": float(stream.average_rate)}


@pytest.fixture(scope="module")
def python_replies(omni_pipeline):
    by_bytes = omni_pipeline.run({"messages": PY_MESSAGES, "videos": [VIDEO]}, GREEDY, timeout=300)
    by_frames = omni_pipeline.run({"messages": PY_MESSAGES, "videos": [pyav_frames(VIDEO)]}, GREEDY, timeout=300)
    return by_bytes, by_frames


def test_video_reply_equals_the_python_api(omni, python_replies):
    reply = omni.chat.completions.create(model="tiny-omni", messages=video_message(VIDEO), temperature=0, max_tokens=8)
    by_bytes, by_frames = python_replies
    assert by_bytes["text"] == by_frames["text"]  # the bytes decode to the frames PyAV gives
    assert reply.choices[0].message.content == by_bytes["text"]
    usage = by_bytes["info"]["usage"]
    assert reply.usage.prompt_tokens == usage["prompt_tokens"]
    text_only = omni.chat.completions.create(
        model="tiny-omni",
        messages=[{"role": "user", "content": "What happens?"}],
        temperature=0,
        max_tokens=8,
    )
    # the video's rows are in the prompt: 4 frames -> grid t 2 x 4 x 6 patches / 4 merged = 12
    assert reply.usage.prompt_tokens >= text_only.usage.prompt_tokens + 12


def encode_mp4_with_sound(frames, fps: int, rate: int = 16000) -> bytes:
    """H.264 frames and an AAC tone as long as they last."""
    seconds = len(frames) / fps
    tone = (0.3 * np.sin(2 * np.pi * 330 * np.arange(int(seconds * rate)) / rate)).astype(np.float32)
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        video = container.add_stream("libx264", rate=fps, options={"preset": "ultrafast"})
        video.height, video.width, video.pix_fmt = frames[0].shape[0], frames[0].shape[1], "yuv420p"
        sound = container.add_stream("aac", rate=rate, layout="mono")
        for f in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")))
        container.mux(video.encode())
        for i in range(0, tone.size, 1024):
            chunk = av.AudioFrame.from_ndarray(tone[None, i : i + 1024].copy(), format="flt", layout="mono")
            chunk.sample_rate = rate
            container.mux(sound.encode(chunk))
        container.mux(sound.encode())
    return out.getvalue()


def test_use_audio_in_video_hears_the_sound_track(omni, omni_pipeline):
    """vLLM's mm_processor_kwargs.use_audio_in_video: the video's sound is the next audio entry,
    interleaved with its frames, as the Python API's thinker param does it."""
    raw = encode_mp4_with_sound(smooth_frames(8, 56, 88, 4), fps=4)
    reply = omni.chat.completions.create(
        model="tiny-omni",
        messages=video_message(raw),
        temperature=0,
        max_tokens=8,
        extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}},
    )
    params = {"thinker": {**GREEDY["thinker"], "use_audio_in_video": True}}
    ref = omni_pipeline.run({"messages": PY_MESSAGES, "videos": [raw], "audio": [raw]}, params, timeout=300)
    assert reply.choices[0].message.content == ref["text"]
    assert reply.usage.prompt_tokens == ref["info"]["usage"]["prompt_tokens"]
    silent = omni.chat.completions.create(model="tiny-omni", messages=video_message(raw), temperature=0, max_tokens=8)
    assert reply.usage.prompt_tokens > silent.usage.prompt_tokens  # the sound's encoder rows are in the prompt
    assert reply.usage.prompt_tokens_details.audio_tokens > 0
    with pytest.raises(openai.BadRequestError) as info:  # VIDEO has no sound track
        omni.chat.completions.create(
            model="tiny-omni", messages=video_message(VIDEO), max_tokens=2,
            extra_body={"mm_processor_kwargs": {"use_audio_in_video": True}},
        )  # fmt: skip
    body = info.value.body
    assert body["param"] == "messages[0].content[0].video_url" and "no sound track" in body["message"], body


def test_video_refusals_name_the_part(omni, client):
    bad = [
        ("data:video/mp4;base64,!!!", "invalid_base64"),
        ("https://example.com/a.mp4", "unsupported_value"),
        ("data:video/mp4;base64," + base64.b64encode(b"\x00" * 4096).decode(), "invalid_video"),
    ]
    for url, code in bad:
        msg = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}]
        with pytest.raises(openai.BadRequestError) as info:
            omni.chat.completions.create(model="tiny-omni", messages=msg, max_tokens=2)
        assert info.value.body["code"] == code, info.value.body
        assert info.value.body["param"] == "messages[0].content[0].video_url"
    with pytest.raises(openai.BadRequestError) as info:  # a pipeline without a videos_in role
        client.chat.completions.create(model="tiny-llm", messages=video_message(VIDEO), max_tokens=2)
    assert info.value.body["param"] == "messages[0].content[0]"
