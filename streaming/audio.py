"""Audio float tensors -> PCM16 bytes / WAV bytes.

Input: torch tensor or numpy array of floats in [-1, 1] (values outside are clipped), shaped
(samples,) for mono or (channels, samples) — the torch/torchaudio convention. A leading
batch dimension of size 1 is dropped ((1, 1, T) from a vocoder is mono).
PCM16 is little-endian, interleaved by channel, sample = round(x * 32767).
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np

from omnistage.streaming.images import to_numpy

AUDIO_MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}


def to_samples_channels(audio: Any) -> np.ndarray:
    """(samples, channels) float32 array from (T,), (C, T) or (1, C, T) input."""
    arr = to_numpy(audio)
    while arr.ndim > 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim == 1:
        arr = arr[:, None]
    elif arr.ndim == 2:
        arr = arr.T
    else:
        raise ValueError(f"audio must be (samples,) or (channels, samples); got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"audio must be floating point in [-1, 1]; got {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def to_pcm16_array(audio: Any) -> np.ndarray:
    """(samples, channels) int16 array."""
    samples = to_samples_channels(audio)
    return np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)


def to_pcm16(audio: Any) -> bytes:
    """Raw little-endian PCM16 bytes (interleaved channels), e.g. for streamed audio chunks."""
    return to_pcm16_array(audio).astype("<i2", copy=False).tobytes()


def encode_wav(audio: Any, sample_rate: int) -> bytes:
    """A complete WAV file (PCM16) written with soundfile."""
    import soundfile as sf

    pcm = to_pcm16_array(audio)
    buf = io.BytesIO()
    sf.write(buf, pcm, int(sample_rate), subtype="PCM_16", format="WAV")
    return buf.getvalue()


def wav_stream_header(sample_rate: int, channels: int = 1) -> bytes:
    """A 44-byte PCM16 WAV header of unknown length, to precede streamed PCM16 chunks.

    The RIFF and data sizes are set to 0xFFFFFFFF ("until the end of the stream"), which
    ffmpeg, browsers and soundfile accept for a stream whose length is not known up front.
    """
    block_align = 2 * channels
    return (
        b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate,
                                sample_rate * block_align, block_align, 16)
        + b"data" + struct.pack("<I", 0xFFFFFFFF)
    )
