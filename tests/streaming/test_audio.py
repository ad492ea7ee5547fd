"""Audio encoders, judged by decoding the bytes back with soundfile."""

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from omnistage.streaming.audio import encode_audio, encode_wav, to_pcm16, wav_stream_header


def _expected_pcm16(x: np.ndarray) -> np.ndarray:
    return np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)


def test_wav_mono_tensor_roundtrip():
    x = torch.sin(torch.linspace(0, 200, 4000)) * 0.8
    x[10] = 1.5  # clipped
    data, sr = sf.read(io.BytesIO(encode_wav(x, 24000)), dtype="int16")
    info = sf.info(io.BytesIO(encode_wav(x, 24000)))
    assert sr == 24000 and info.subtype == "PCM_16" and info.channels == 1
    np.testing.assert_array_equal(data, _expected_pcm16(x.numpy()))
    as_float, _ = sf.read(io.BytesIO(encode_wav(x, 24000)), dtype="float32")
    # soundfile scales int16 back by 1/32768: half a step of rounding plus that scale gap.
    assert np.abs(as_float - np.clip(x.numpy(), -1, 1)).max() <= 2.0 / 32767


def test_wav_stereo_channels_first():
    x = np.random.default_rng(0).uniform(-1, 1, (2, 1000)).astype(np.float32)
    data, sr = sf.read(io.BytesIO(encode_wav(x, 16000)), dtype="int16")
    assert data.shape == (1000, 2)
    np.testing.assert_array_equal(data, _expected_pcm16(x.T))


def test_vocoder_shaped_batch_of_one_is_mono():
    x = torch.rand(1, 1, 500) * 2 - 1
    pcm = np.frombuffer(to_pcm16(x), dtype="<i2")
    np.testing.assert_array_equal(pcm, _expected_pcm16(x.reshape(-1).numpy()))


def test_streamed_header_plus_pcm_chunks_decodes():
    x = np.random.default_rng(1).uniform(-1, 1, 3000).astype(np.float32)
    stream = wav_stream_header(22050) + b"".join(to_pcm16(x[i : i + 700]) for i in range(0, 3000, 700))
    data, sr = sf.read(io.BytesIO(stream), dtype="int16")
    assert sr == 22050
    np.testing.assert_array_equal(data, _expected_pcm16(x))


def test_rejects_integer_audio():
    with pytest.raises(ValueError, match="floating"):
        to_pcm16(np.zeros(10, dtype=np.int16))


def _decode_any(data: bytes) -> tuple[np.ndarray, int, str]:
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        name, rate = stream.codec_context.name, stream.sample_rate
        parts = []
        for frame in container.decode(audio=0):
            arr = frame.to_ndarray()
            arr = arr / 32768.0 if arr.dtype == np.int16 else arr
            parts.append(arr[0] if arr.shape[0] == 1 else arr.reshape(-1))  # mono
    return np.concatenate(parts), rate, name


def _aligned_snr_db(decoded: np.ndarray, reference: np.ndarray, max_lag: int = 4096) -> float:
    # Codecs add priming/delay samples: find the lag that lines the decoded signal up best.
    n = len(reference) - 2 * max_lag
    core = reference[max_lag : max_lag + n]
    best = -np.inf
    for lag in range(0, 2 * max_lag + 1, 1):
        seg = decoded[lag : lag + n]
        if len(seg) < n:
            break
        noise = np.sum((seg - core) ** 2)
        best = max(best, 10 * np.log10(np.sum(core**2) / max(noise, 1e-20)))
    return best


def _tones(sr: int, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    return (0.5 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1234 * t)).astype(np.float32)


def test_flac_is_lossless_pcm16():
    x = np.random.default_rng(2).uniform(-1, 1, 5000).astype(np.float32)
    data, sr = sf.read(io.BytesIO(encode_audio(x, 16000, "flac")), dtype="int16")
    assert sr == 16000
    np.testing.assert_array_equal(data, _expected_pcm16(x))


def test_flac_stereo_keeps_channels_apart():
    x = np.stack([_tones(16000, 0.25), -0.5 * _tones(16000, 0.25)[::-1]])  # (2, T)
    data, sr = sf.read(io.BytesIO(encode_audio(x, 16000, "flac")), dtype="int16")
    assert data.shape == (x.shape[1], 2)
    np.testing.assert_array_equal(data, _expected_pcm16(x.T))


@pytest.mark.parametrize("fmt,codec,min_snr_db", [("mp3", "mp3", 20.0), ("aac", "aac", 20.0), ("opus", "opus", 15.0)])
def test_lossy_formats_decode_close_to_input(fmt, codec, min_snr_db):
    sr = 24000
    x = _tones(sr)
    decoded, rate, name = _decode_any(encode_audio(x, sr, fmt))
    assert name.startswith(codec)
    reference = x
    if rate != sr:  # ffmpeg decodes Ogg Opus at 48 kHz: compare with the tones at that rate
        reference = _tones(rate)
    assert abs(len(decoded) - len(reference)) <= 4096
    assert _aligned_snr_db(decoded, reference) >= min_snr_db


def test_an_empty_clip_encodes_to_an_empty_stream():
    """A talker may end at its first step: the answer is an empty stream, not an FFmpeg error."""
    empty = np.zeros(0, np.float32)
    data, sr = sf.read(io.BytesIO(encode_audio(empty, 24000, "wav")), dtype="int16")
    assert sr == 24000 and len(data) == 0
    import av

    with av.open(io.BytesIO(encode_audio(empty, 24000, "flac"))) as container:  # the header alone
        assert container.streams.audio[0].sample_rate == 24000
        assert not list(container.decode(audio=0))
    for fmt in ("mp3", "aac", "opus"):  # frame streams without a frame
        assert encode_audio(empty, 24000, fmt) == b""


def test_unsupported_audio_format():
    with pytest.raises(ValueError, match="unsupported audio format"):
        encode_audio(np.zeros(10, np.float32), 16000, "ogg-vorbis")
