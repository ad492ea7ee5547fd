"""configs/tiny-omni.yaml end to end in worker processes: text and codec tokens equal
transformers' Qwen2.5-Omni, speech arrives while the thinker is still writing, and a text-only
request produces no speech."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from omnistage.runtime.pipeline import Pipeline

from .test_talker import N_CODES, N_TEXT, reference_codes
from .test_thinker import _clip, _messages, _reference


@pytest.fixture(scope="module")
def omni_pipeline():
    with Pipeline.from_yaml("tiny-omni", start=True, wait_ready=True, ready_timeout=600) as p:
        yield p


async def _collect(pipeline, inputs, params):
    """Every chunk with its arrival time: [(port, data, t)]."""
    chunks = []
    async for c in pipeline.stream(inputs, params):
        chunks.append((c.port, c.data, time.monotonic()))
    return chunks


def _params(speech: bool, voice: str = "Ethan", max_tokens: int = N_TEXT):
    thinker = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, "return_audio": speech}
    return {
        "thinker": thinker,
        "talker": {"temperature": 0, "max_tokens": N_CODES, "voice": voice},
        "token2wav": {"voice": voice, "seed": 0},
    }


def test_audio_in_speech_out_equals_transformers(omni_pipeline, omni_dir, omni_ref):
    from transformers import AutoTokenizer

    clip = _clip(1.6, 21)
    messages = _messages(1, "What do you hear?")
    tokens, _, _ = _reference(omni_ref, omni_dir, messages, [clip], True, N_TEXT)
    codes, _ = reference_codes(omni_ref, omni_dir, messages, [clip], "Ethan")
    inputs = {"messages": messages, "audio": [{"samples": clip, "sampling_rate": 16000}]}
    chunks = asyncio.run(_collect(omni_pipeline, inputs, _params(True)))
    by_port = {}
    for port, data, _ in chunks:
        if data is not None:
            by_port.setdefault(port, []).append(data)
    text = "".join(by_port["text"])
    tok = AutoTokenizer.from_pretrained(str(omni_dir))
    assert text == tok.decode(tokens, skip_special_tokens=True)
    assert [c for part in by_port["codes"] for c in part] == codes
    audio = torch.cat([torch.as_tensor(a).reshape(-1) for a in by_port["audio"]])
    assert audio.numel() > 0 and torch.isfinite(audio).all() and audio.abs().max() > 1e-3
    assert by_port["speech_info"][0]["usage"]["codec_tokens"] == len(codes)


def test_image_and_audio_in_text_out_equals_transformers(omni_pipeline, omni_dir, omni_ref):
    from transformers import AutoTokenizer

    from .test_vision import _image, _png, reference_tokens

    img, clip = _image(70, 98, 8), _clip(0.8, 9)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Hm?"}]}]
    tokens, _ = reference_tokens(omni_ref, omni_dir, messages, [img], [clip], False, N_TEXT)
    inputs = {"messages": messages, "images": [_png(img)], "audio": [{"samples": clip, "sampling_rate": 16000}]}
    out = omni_pipeline.run(inputs, _params(False), timeout=120)
    assert out["text"] == AutoTokenizer.from_pretrained(str(omni_dir)).decode(tokens, skip_special_tokens=True)
    assert out["info"]["usage"]["completion_tokens"] == N_TEXT


def _requests_seen(pipeline, stage: str) -> int:
    return sum(sum(r["outcomes"].values()) for r in pipeline.replica_stats()[stage])


@pytest.mark.parametrize("text_only", [{"return_audio": False}, {"modalities": ["text"]}])
def test_text_only_request_never_reaches_talker_or_token2wav(omni_pipeline, omni_dir, omni_ref, text_only):
    """The thinker declares its talker port absent: talker and token2wav never see the request
    (their workers count no request), the speech outputs end empty."""
    from transformers import AutoTokenizer

    messages = _messages(0, "Tell me a short story about the sea.")
    tokens, _, _ = _reference(omni_ref, omni_dir, messages, [], False, N_TEXT)
    before = {s: _requests_seen(omni_pipeline, s) for s in ("thinker", "talker", "token2wav")}
    params = _params(True)
    del params["thinker"]["return_audio"]
    params["thinker"].update(text_only)
    out = omni_pipeline.run({"messages": messages}, params, timeout=120)
    tok = AutoTokenizer.from_pretrained(str(omni_dir))
    assert out["text"] == tok.decode(tokens, skip_special_tokens=True)
    assert out["info"]["usage"]["completion_tokens"] == N_TEXT
    assert not out["codes"] and out["audio"] is None and out["speech_info"] is None
    after = {s: _requests_seen(omni_pipeline, s) for s in ("thinker", "talker", "token2wav")}
    assert {s: after[s] - before[s] for s in after} == {"thinker": 1, "talker": 0, "token2wav": 0}


def test_first_audio_leaves_before_the_thinker_finishes(omni_pipeline):
    """A long answer: the first speech chunk reaches the caller before the thinker's last text."""
    messages = _messages(0, "Talk for a while.")
    params = _params(True, "Chelsie", max_tokens=3000)
    params["talker"].update(min_tokens=100, max_tokens=300)
    t0 = time.monotonic()
    chunks = asyncio.run(_collect(omni_pipeline, {"messages": messages}, params))
    first_audio = min(t for port, data, t in chunks if port == "audio" and data is not None and np.size(data))
    first_text = min(t for port, data, t in chunks if port == "text" and data)
    last_text = max(t for port, data, t in chunks if port == "text" and data)
    print(f"first text {first_text - t0:.2f} s, first audio {first_audio - t0:.2f} s, last text {last_text - t0:.2f} s")
    assert first_audio < last_text


def test_cancel_mid_speech_frees_both_kv_pools(omni_pipeline):
    """Leaving the stream early (after the first audio) aborts the request in every stage:
    thinker and talker give back every KV block, hold no request, and the talker stopped
    (it was asked for at least 3000 codec tokens)."""
    before = omni_pipeline.stage_stats()["talker"]["generated_tokens"]

    async def first_audio_then_leave():
        params = _params(True, "Ethan", max_tokens=3000)
        params["talker"].update(min_tokens=3000, max_tokens=3000)
        async for c in omni_pipeline.stream({"messages": _messages(0, "Talk for a while.")}, params):
            if c.port == "audio" and c.data is not None and np.size(c.data):
                return True
        return False

    assert asyncio.run(first_audio_then_leave())
    deadline = time.monotonic() + 30
    while True:
        stats = omni_pipeline.stage_stats()
        freed = all(stats[s]["kv_blocks_free"] == stats[s]["kv_blocks_total"] for s in ("thinker", "talker"))
        idle = all(stats[s]["requests_live"] == 0 for s in ("thinker", "talker"))
        if freed and idle:
            break
        assert time.monotonic() < deadline, {s: stats[s] for s in ("thinker", "talker")}
        time.sleep(0.2)
    assert stats["talker"]["generated_tokens"] - before < 3000


def test_eight_concurrent_requests_get_what_they_get_alone(omni_pipeline):
    """Different prompts, audio and voices at once through all five stages: text, codes and
    speech of each equal the same request run alone."""
    requests = []
    for i in range(8):
        clip = _clip(0.3 + 0.25 * i, 60 + i)
        voice = ("Chelsie", "Ethan")[i % 2]
        parts = 1 if i % 3 else 0
        inputs = {"messages": _messages(parts, f"Question number {i}?")}
        if parts:
            inputs["audio"] = [{"samples": clip, "sampling_rate": 16000}]
        params = _params(True, voice, max_tokens=8)
        params["talker"]["max_tokens"] = 24
        params["token2wav"]["seed"] = i
        requests.append((inputs, params))

    def summary(out):
        audio = out["audio"]
        return out["text"], list(out["codes"] or []), None if audio is None else torch.as_tensor(audio).reshape(-1)

    alone = [summary(omni_pipeline.run(inp, par, timeout=300)) for inp, par in requests]

    async def together():
        return await asyncio.gather(*(omni_pipeline.generate(inp, par) for inp, par in requests))

    for (text, codes, audio), out in zip(alone, asyncio.run(together())):
        got_text, got_codes, got_audio = summary(out)
        assert (got_text, got_codes) == (text, codes)
        assert (audio is None) == (got_audio is None)
        if audio is not None:
            assert got_audio.shape == audio.shape
            torch.testing.assert_close(got_audio, audio, rtol=0, atol=1e-4)
    assert len({c for _, codes, _ in alone for c in codes}) >= 10


def test_voice_named_once_reaches_token2wav(omni_pipeline):
    """The talker forwards its voice to token2wav: naming it for the talker alone gives the same
    speech as naming it on both stages; token2wav's own voice param still wins (token2wav's
    default, Chelsie, differs from the talker's Ethan here)."""
    messages = _messages(1, "Say something.")
    inputs = {"messages": messages, "audio": [{"samples": _clip(0.7, 5), "sampling_rate": 16000}]}

    def speech(token2wav: dict) -> torch.Tensor:
        params = _params(True, "Ethan")
        params["token2wav"] = {"seed": 0, **token2wav}
        out = omni_pipeline.run(inputs, params, timeout=120)
        return torch.as_tensor(out["audio"]).reshape(-1)

    once, both, other = speech({}), speech({"voice": "Ethan"}), speech({"voice": "Chelsie"})
    assert once.numel() > 0 and once.abs().max() > 1e-3
    torch.testing.assert_close(once, both, rtol=0, atol=1e-6)
    assert once.shape == other.shape and (once - other).abs().max() > 1e-3


def test_speak_says_the_text_through_the_pipeline(omni_pipeline, omni_dir, omni_ref):
    """Text-to-speech (the `speak` input, what serves.speech maps): the talker's codes equal
    transformers' for a thinker forced to write that text, in the voice named for the talker,
    and the speech is non-trivial."""
    from transformers import AutoTokenizer

    say = "Good evening, and welcome."
    forced = AutoTokenizer.from_pretrained(str(omni_dir))(say, add_special_tokens=False)["input_ids"]
    speech = {}
    for voice in ("Ethan", "Chelsie"):
        expected, _ = reference_codes(omni_ref, omni_dir, [{"role": "user", "content": say}], [], voice, forced=forced)
        params = {"talker": {"temperature": 0, "max_tokens": N_CODES, "voice": voice}, "token2wav": {"seed": 0}}
        out = omni_pipeline.run({"speak": say}, params, timeout=120)
        assert out["text"] == say and list(out["codes"]) == expected
        audio = torch.as_tensor(out["audio"]).reshape(-1)
        assert audio.numel() == 480 * len(expected) and audio.abs().max() > 1e-3 and audio.std() > 1e-4
        speech[voice] = list(out["codes"])
    assert speech["Ethan"] != speech["Chelsie"]


def test_mp4_with_its_sound_through_the_pipeline_equals_transformers(omni_pipeline, omni_dir, omni_ref, tmp_path):
    """A video file given twice (as the video and as its audio) with use_audio_in_video: the
    workers decode frames and sound, and the answer is transformers' for those frames and sound."""
    from transformers import AutoTokenizer

    from omnistage.stages.omni.inputs import decode_audio
    from omnistage.stages.omni.video import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, VideoPatcher, load_frames

    from .test_video import _frames, _mp4, _reference, _vision_config

    frames = np.repeat(np.repeat(_frames(12, 14, 21, 4), 4, axis=1), 4, axis=2)
    raw = _mp4(frames, 4, _clip(3.0, 8))
    video = dict(zip(("frames", "fps"), load_frames(raw)))
    patches = VideoPatcher(_vision_config(omni_dir), VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)(video)
    parts = [{"type": "video"}, {"type": "text", "text": "What happens?"}]
    messages = [{"role": "user", "content": parts}]
    _, _, tokens = _reference(omni_ref, omni_dir, messages, video, patches, decode_audio(raw, 16000), True)
    path = tmp_path / "clip.mp4"
    path.write_bytes(raw)
    params = _params(False)
    params["thinker"].update(max_tokens=10, use_audio_in_video=True)
    out = omni_pipeline.run({"messages": messages, "videos": [str(path)], "audio": [raw]}, params, timeout=120)
    assert out["text"] == AutoTokenizer.from_pretrained(str(omni_dir)).decode(tokens, skip_special_tokens=True)


MEDIA_PARTS = {"audio": "audio", "images": "image", "videos": "video"}


def _one_media_request(port: str, value) -> dict:
    parts = [{"type": MEDIA_PARTS[port]}, {"type": "text", "text": "What is this?"}]
    return {"messages": [{"role": "user", "content": parts}], port: [value]}


def test_media_bombs_given_to_the_pipeline_are_refused_before_they_cost_memory(omni_pipeline, tmp_path):
    """The chat route checks media before an answer starts; media given to the pipeline itself
    (the Python API, a path, raw samples) meet the same bounds in the stages that decode them:
    each is refused naming its port and the workers' peak memory hardly moves (the video
    below is 1.1 GiB as RGB, the image 300 MB)."""
    from omnistage.errors import InvalidRequestError
    from omnistage.tests.reliability.media_bombs import flac_silence, peak_rss, png_declaring, repeated_mp4, wav

    from .test_video import _frames, _mp4
    from .test_vision import _image, _png

    small_video = _mp4(np.repeat(np.repeat(_frames(4, 14, 21, 4), 4, axis=1), 4, axis=2), 4, _clip(1.0, 8))
    params = _params(False, max_tokens=2)
    ok = {"audio": wav(16_000, 8_000), "images": _png(_image(28, 28, 0)), "videos": small_video}
    for port, value in ok.items():  # warm every decoder up, so its first use is not counted below
        assert omni_pipeline.run(_one_media_request(port, value), params, timeout=120)["text"] is not None
    endless = tmp_path / "sparse.mp4"
    with endless.open("wb") as f:
        f.truncate(65 << 20)  # a sparse file past the 64 MiB a video may have
    cases = [
        ("videos", repeated_mp4(1080, 1920, 180, 24), "video_too_large"),
        ("videos", repeated_mp4(16, 16, 7300, 30), "video_too_many_frames"),
        ("videos", str(endless), "input_too_large"),
        ("images", png_declaring(10_000, 10_000), "image_too_large"),
        ("images", png_declaring(50_000, 50_000), "image_too_large"),
        ("audio", wav(1, 16_000), "invalid_sample_rate"),
        ("audio", {"samples": np.zeros(16_000, np.float32), "sampling_rate": 1}, "invalid_sample_rate"),
        ("audio", flac_silence(4000, 21 * 60), "audio_too_long"),
    ]
    workers = [pid for pids in omni_pipeline.worker_pids().values() for pid in pids if pid is not None]
    before = {pid: peak_rss(pid)[pid] for pid in workers}
    for port, value, code in cases:
        with pytest.raises(InvalidRequestError) as info:
            omni_pipeline.run(_one_media_request(port, value), params, timeout=120)
        assert (info.value.code, info.value.param) == (code, port), str(info.value)
        assert info.value.status == (413 if code == "video_too_large" else 400)  # as the chat route answers
    growth = {pid: (peak_rss(pid)[pid] - before[pid]) >> 20 for pid in workers}
    assert max(growth.values()) < 64, f"peak RSS growth per worker (MiB): {growth}"
    assert omni_pipeline.run(_one_media_request("videos", small_video), params, timeout=120)["text"] is not None
