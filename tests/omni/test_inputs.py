"""Omni input processing against transformers' own Qwen2.5-Omni processor, and audio decoding."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.omni.inputs import SPEECH_SYSTEM_PROMPT, OmniProcessor

from .conftest import reference_processor


def _noise(seconds: float, seed: int, rate: int = 16000) -> np.ndarray:
    return (np.random.RandomState(seed).randn(int(seconds * rate)) * 0.1).astype(np.float32)


def test_prompt_and_features_equal_the_transformers_processor(omni_dir):
    ours = OmniProcessor(omni_dir)
    ref = reference_processor(omni_dir)
    audios = [_noise(1.37, 0), _noise(2.9, 1), _noise(0.2, 2)]
    messages = [
        {"role": "user", "content": [{"type": "audio", "audio": "a"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A sound."},
        {"role": "user", "content": [{"type": "audio", "audio": "b"}, {"type": "audio", "audio": "c"}, {"type": "text", "text": "And these?"}]},
    ]  # fmt: skip
    text = ours.prompt_text(messages, speech=True)
    assert SPEECH_SYSTEM_PROMPT in text
    expected = ref(text=[text], audio=audios, return_tensors="pt")
    feats = [ours.audio_features({"samples": a, "sampling_rate": 16000}) for a in audios]
    ids = ours.expand_audio(text, [f.num_tokens for f in feats])
    assert ids == expected["input_ids"][0].tolist()
    assert ids.count(ours.audio_token_id) == sum(f.num_tokens for f in feats) > 50
    mask = expected["feature_attention_mask"].bool()
    for i, f in enumerate(feats):
        ref_frames = expected["input_features"][i][:, mask[i]]
        assert f.features.shape == ref_frames.shape
        torch.testing.assert_close(f.features, ref_frames, rtol=0, atol=0)


def test_text_prompt_without_speech_keeps_the_default_system_line(omni_dir):
    ours = OmniProcessor(omni_dir)
    text = ours.prompt_text([{"role": "user", "content": "hi"}])
    assert SPEECH_SYSTEM_PROMPT not in text and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(InvalidRequestError) as err:
        ours.expand_audio(text, [5])
    assert err.value.param == "audio"


def _sine(rate: int, seconds: float, channels: int, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    x = (0.4 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return np.stack([x] * channels, axis=1)


def _encode_soundfile(fmt: str, rate: int, channels: int) -> bytes:
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, _sine(rate, 1.0, channels), rate, format=fmt)
    return buf.getvalue()


def _encode_pyav(codec: str, container_fmt: str, rate: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container_fmt) as out:
        stream = out.add_stream(codec, rate=rate, layout="stereo")
        samples = _sine(rate, 1.0, 2).T.copy()  # planar [channels, samples]
        frame_size = 960 if codec == "libopus" else 1152
        for start in range(0, samples.shape[1], frame_size):
            chunk = np.ascontiguousarray(samples[:, start : start + frame_size])
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize(
    "make",
    [
        lambda: _encode_soundfile("WAV", 44100, 2),
        lambda: _encode_soundfile("FLAC", 22050, 1),
        lambda: _encode_soundfile("OGG", 48000, 2),
        lambda: _encode_pyav("libopus", "ogg", 48000),
        lambda: _encode_pyav("libmp3lame", "mp3", 44100),
    ],
    ids=["wav44k-stereo", "flac22k", "vorbis48k", "opus48k", "mp3-44k"],
)
def test_audio_in_common_formats_becomes_16k_mono(omni_dir, make):
    try:
        data = make()
    except Exception as exc:  # noqa: BLE001 - an encoder this PyAV build lacks
        pytest.skip(f"encoder unavailable: {exc}")
    samples = OmniProcessor(omni_dir).load_audio(data)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) - 16000) < 0.06 * 16000  # codecs pad a few ms
    spectrum = np.abs(np.fft.rfft(samples[2000:14000]))
    peak_hz = np.argmax(spectrum) * 16000 / 12000
    assert abs(peak_hz - 440) < 3
    assert 0.25 < np.abs(samples[2000:14000]).max() < 0.55


def test_undecodable_audio_is_the_requests_fault(omni_dir):
    ours = OmniProcessor(omni_dir)
    for bad in (b"not audio at all" * 10, b""):
        with pytest.raises(InvalidRequestError) as err:
            ours.audio_features(bad)
        assert err.value.param == "audio"


@pytest.mark.parametrize("seconds", [0.01, 0.05, 0.3, 0.99, 3.0101, 7.77, 29.995, 31.0])
def test_features_equal_the_extraction_padded_to_30_seconds(omni_dir, seconds):
    """The extractor run on the audio padded to its whole 30 s window (as the model's
    processor runs it), its real frames kept: bit for bit what audio_features gives from its
    shorter padding; audio past 30 s is cut."""
    ours = OmniProcessor(omni_dir)
    audio = _noise(seconds, int(seconds * 1000))
    audio[: len(audio) // 3] *= 40  # a loud start: the log-mel floor comes from it
    fe = ours.feature_extractor
    full = fe(
        audio[: fe.n_samples],
        sampling_rate=16000,
        padding="max_length",
        return_attention_mask=True,
        return_tensors="pt",
    )
    frames = int(full["attention_mask"][0].sum())
    got = ours.audio_features({"samples": audio, "sampling_rate": 16000})
    assert got.features.shape == (fe.feature_size, frames)
    torch.testing.assert_close(got.features, full["input_features"][0, :, :frames], rtol=0, atol=0)
