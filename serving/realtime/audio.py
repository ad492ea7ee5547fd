"""Audio formats of a realtime session: what `input_audio_buffer.append` carries and what
`response.output_audio.delta` sends, to and from the float32 24 kHz mono samples the session
keeps.

`audio/pcm` is little-endian 16-bit mono, 24 kHz unless the format names another `rate` (then
resampled with torchaudio); `audio/pcmu` and `audio/pcma` are G.711 mu-law and A-law at 8 kHz.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np

SESSION_RATE = 24_000  # what the session keeps and the omni pipeline speaks
G711_RATE = 8_000
FORMAT_TYPES = ("audio/pcm", "audio/pcmu", "audio/pcma")
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}


class AudioDataError(ValueError):
    """Audio bytes that do not fit their declared format (the session answers with an error event)."""


@dataclass(frozen=True)
class AudioFormat:
    type: str = "audio/pcm"
    rate: int = SESSION_RATE

    def __post_init__(self) -> None:
        if self.type not in FORMAT_TYPES:
            raise ValueError(f"audio format type must be one of {', '.join(FORMAT_TYPES)}, got {self.type!r}")
        if not 8_000 <= self.rate <= 48_000:
            raise ValueError(f"audio format rate must be within 8000..48000 Hz, got {self.rate}")

    @classmethod
    def parse(cls, value: object) -> AudioFormat:
        """A GA format object ({"type": ..., "rate": ...}) or a beta name ("pcm16", "g711_ulaw", ...)."""
        if isinstance(value, str):
            if value not in BETA_FORMATS:
                raise ValueError(f"unknown audio format {value!r} (known: {', '.join(BETA_FORMATS)})")
            return cls.parse({"type": BETA_FORMATS[value]})
        if not isinstance(value, dict):
            raise ValueError("an audio format is an object {type, rate} or a name such as 'pcm16'")
        kind = value.get("type", "audio/pcm")
        rate = value.get("rate") if kind == "audio/pcm" else None
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int)):
            raise ValueError("audio format rate must be an integer (Hz)")
        return cls(kind, rate if rate is not None else (SESSION_RATE if kind == "audio/pcm" else G711_RATE))

    def as_dict(self) -> dict:
        return {"type": self.type, "rate": self.rate} if self.type == "audio/pcm" else {"type": self.type}

    @property
    def bytes_per_second(self) -> int:
        return self.rate * (2 if self.type == "audio/pcm" else 1)

    def decode(self, data: bytes) -> np.ndarray:
        """Raw bytes in this format -> float32 samples at SESSION_RATE."""
        if self.type == "audio/pcm":
            if len(data) % 2:
                raise AudioDataError("audio/pcm data must hold whole 16-bit samples (an even number of bytes)")
            samples = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
        elif self.type == "audio/pcmu":
            samples = ulaw_decode(np.frombuffer(data, dtype=np.uint8))
        else:
            samples = alaw_decode(np.frombuffer(data, dtype=np.uint8))
        return resample(samples, self.rate, SESSION_RATE)

    def encode(self, samples: np.ndarray) -> bytes:
        """float32 samples at SESSION_RATE -> raw bytes in this format."""
        x = np.clip(resample(np.asarray(samples, dtype=np.float32).reshape(-1), SESSION_RATE, self.rate), -1.0, 1.0)
        if self.type == "audio/pcm":
            return np.clip((x * 32768.0).round(), -32768, 32767).astype("<i2").tobytes()  # inverse of decode
        return (ulaw_encode(x) if self.type == "audio/pcmu" else alaw_encode(x)).tobytes()


def decode_b64(data: object) -> bytes:
    if not isinstance(data, str):
        raise AudioDataError("audio must be a base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioDataError(f"audio is not valid base64: {exc}") from exc


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target or samples.size == 0:
        return np.asarray(samples, dtype=np.float32)
    import torch
    import torchaudio.functional as AF

    out = AF.resample(torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)), rate, target)
    return out.numpy()


# G.711 (ITU-T): 8-bit logarithmic codes, sign + 3-bit segment + 4-bit mantissa.
_ULAW_BIAS, _ULAW_CLIP = 0x84, 8159  # the bias on 16-bit magnitudes; the clip on 14-bit ones


def ulaw_encode(x: np.ndarray) -> np.ndarray:
    pcm = (np.asarray(x, dtype=np.float32) * 32767.0).round().astype(np.int32) >> 2  # 14-bit
    sign = np.where(pcm < 0, 0x7F, 0xFF)
    mag = np.minimum(np.where(pcm < 0, -pcm, pcm), _ULAW_CLIP) + (_ULAW_BIAS >> 2)
    exponent = np.floor(np.log2(mag)).astype(np.int32) - 5
    mantissa = (mag >> (exponent + 1)) & 0x0F
    code = np.where(exponent > 7, 0x7F, (exponent << 4) | mantissa)  # past the last segment: full scale
    return (code ^ sign).astype(np.uint8)


def ulaw_decode(codes: np.ndarray) -> np.ndarray:
    u = ~codes.astype(np.int32) & 0xFF
    exponent, mantissa = (u >> 4) & 0x07, u & 0x0F
    mag = (((mantissa << 3) + _ULAW_BIAS) << exponent) - _ULAW_BIAS
    return (np.where(u & 0x80, -mag, mag) / 32768.0).astype(np.float32)


def alaw_encode(x: np.ndarray) -> np.ndarray:
    pcm = (np.asarray(x, dtype=np.float32) * 32767.0).round().astype(np.int32) >> 3  # 13-bit
    sign = np.where(pcm >= 0, 0x80, 0)
    mag = np.minimum(np.where(pcm < 0, -pcm - 1, pcm), 0x0FFF)
    exponent = np.where(mag < 32, 0, np.floor(np.log2(np.maximum(mag, 1))).astype(np.int32) - 4)
    mantissa = np.where(exponent == 0, mag >> 1, mag >> exponent) & 0x0F
    return ((sign | (exponent << 4) | mantissa) ^ 0x55).astype(np.uint8)


def alaw_decode(codes: np.ndarray) -> np.ndarray:
    a = codes.astype(np.int32) ^ 0x55
    exponent, mantissa = (a >> 4) & 0x07, a & 0x0F
    mag = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return (np.where(a & 0x80, mag, -mag) / 32768.0).astype(np.float32)
