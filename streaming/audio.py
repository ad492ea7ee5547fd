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
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, 16)
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


# -- compressed formats (OpenAI speech `response_format`) --------------------------------------
# format -> (container, codec, media type)
AUDIO_CODECS = {
    "mp3": ("mp3", "libmp3lame", "audio/mpeg"),
    "opus": ("ogg", "libopus", "audio/ogg"),
    "aac": ("adts", "aac", "audio/aac"),
    "flac": ("flac", "flac", "audio/flac"),
}
AUDIO_FORMATS = ("wav", "pcm", *AUDIO_CODECS)
AUDIO_MEDIA_TYPES.update({fmt: media for fmt, (_, _, media) in AUDIO_CODECS.items()})


def encode_audio(audio: Any, sample_rate: int, fmt: str = "wav", *, bitrate: int | None = None) -> bytes:
    """Encode a whole clip as wav | pcm | mp3 | opus | aac | flac.

    wav/pcm are PCM16 (see module doc); flac is lossless PCM16; mp3/opus/aac are lossy, at
    `bitrate` bits/s (default 128k; 64k for opus). A rate the codec cannot take (opus runs at
    8/12/16/24/48 kHz, mp3 and aac at the usual rates) is resampled to the nearest higher
    supported one; the decoded stream reports the rate it was encoded at.
    """
    fmt = fmt.lower()
    if fmt == "wav":
        return encode_wav(audio, sample_rate)
    if fmt == "pcm":
        return to_pcm16(audio)
    if fmt not in AUDIO_CODECS:
        raise ValueError(f"unsupported audio format {fmt!r}; choose one of {', '.join(AUDIO_FORMATS)}")
    import av

    container_fmt, codec_name, _ = AUDIO_CODECS[fmt]
    pcm = to_pcm16_array(audio)  # (samples, channels) int16
    channels = pcm.shape[1]
    if channels > 2:
        raise ValueError(f"{fmt} output supports mono or stereo, not {channels} channels")
    codec = av.codec.Codec(codec_name, "w")
    rates = sorted(codec.audio_rates or [])
    out_rate = int(sample_rate)
    if rates and out_rate not in rates:
        out_rate = next((r for r in rates if r >= out_rate), rates[-1])
    layout = "mono" if channels == 1 else "stereo"

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container_fmt) as container:
        stream = container.add_stream(codec_name, rate=out_rate, layout=layout)
        if fmt != "flac":
            stream.bit_rate = bitrate or (64_000 if fmt == "opus" else 128_000)
        sample_fmt = codec.audio_formats[0].name
        resampler = av.AudioResampler(format=sample_fmt, layout=layout, rate=out_rate)
        # packed s16 wants one row of interleaved samples: (samples, channels) flattened
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm.reshape(1, -1)), format="s16", layout=layout)
        frame.sample_rate = int(sample_rate)
        chunks = (*resampler.resample(frame), *resampler.resample(None)) if pcm.size else ()
        for chunk in chunks:  # an empty clip is only the container's header (FFmpeg refuses 0 samples)
            container.mux(stream.encode(chunk))
        container.mux(stream.encode(None))
    return buf.getvalue()
