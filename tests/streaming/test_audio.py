"""Audio encoders, judged by decoding the bytes back with soundfile."""

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from omnistage.streaming.audio import encode_wav, to_pcm16, wav_stream_header


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
    stream = wav_stream_header(22050) + b"".join(to_pcm16(x[i:i + 700]) for i in range(0, 3000, 700))
    data, sr = sf.read(io.BytesIO(stream), dtype="int16")
    assert sr == 22050
    np.testing.assert_array_equal(data, _expected_pcm16(x))


def test_rejects_integer_audio():
    with pytest.raises(ValueError, match="floating"):
        to_pcm16(np.zeros(10, dtype=np.int16))
