"""Audio formats of a realtime session: what `input_audio_buffer.append` carries and what
`response.output_audio.delta` sends, to and from the float32 24 kHz mono samples the session
keeps.

`audio/pcm` is little-endian 16-bit mono, 24 kHz unless the format names another `rate` (then
resampled with torchaudio's windowed-sinc kernel); `audio/pcmu` and `audio/pcma` are G.711
mu-law and A-law at 8 kHz. A stream of packets (the appended microphone, an answer's deltas)
is resampled by a `StreamResampler`, so it gets the samples of resampling the whole stream at
once: resampling each packet alone would pad both its edges with zeros, a click every packet.
"""

from __future__ import annotations

import base64
import binascii
import functools
import math
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

    def to_samples(self, data: bytes) -> np.ndarray:
        """Raw bytes in this format -> float32 samples at the format's own rate."""
        if self.type == "audio/pcm":
            if len(data) % 2:
                raise AudioDataError("audio/pcm data must hold whole 16-bit samples (an even number of bytes)")
            return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
        if self.type == "audio/pcmu":
            return ulaw_decode(np.frombuffer(data, dtype=np.uint8))
        return alaw_decode(np.frombuffer(data, dtype=np.uint8))

    def from_samples(self, samples: np.ndarray) -> bytes:
        """float32 samples at the format's own rate -> raw bytes in this format."""
        x = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
        if self.type == "audio/pcm":
            return np.clip((x * 32768.0).round(), -32768, 32767).astype("<i2").tobytes()  # inverse of to_samples
        return (ulaw_encode(x) if self.type == "audio/pcmu" else alaw_encode(x)).tobytes()

    def decode(self, data: bytes) -> np.ndarray:
        """Raw bytes of a whole clip in this format -> float32 samples at SESSION_RATE."""
        return resample(self.to_samples(data), self.rate, SESSION_RATE)

    def encode(self, samples: np.ndarray) -> bytes:
        """A whole clip of float32 samples at SESSION_RATE -> raw bytes in this format."""
        return self.from_samples(resample(np.asarray(samples, dtype=np.float32).reshape(-1), SESSION_RATE, self.rate))

    def input_stream(self) -> StreamResampler:
        """A resampler for a stream of packets in this format, to SESSION_RATE."""
        return StreamResampler(self.rate, SESSION_RATE)

    def output_stream(self) -> StreamResampler:
        """A resampler for a stream at SESSION_RATE, to this format's rate."""
        return StreamResampler(SESSION_RATE, self.rate)


def decode_b64(data: object) -> bytes:
    if not isinstance(data, str):
        raise AudioDataError("audio must be a base64 string")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioDataError(f"audio is not valid base64: {exc}") from exc


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """A whole clip from `rate` to `target` Hz."""
    if rate == target or samples.size == 0:
        return np.asarray(samples, dtype=np.float32)
    return _run(_kernel(rate, target), np.asarray(samples, dtype=np.float32))


@functools.lru_cache(maxsize=16)
def _kernel(rate: int, target: int):
    """torchaudio's Resample module (its windowed-sinc kernel, built once per rate pair)."""
    import torchaudio.transforms as T

    return T.Resample(rate, target)


def _run(module, samples: np.ndarray) -> np.ndarray:
    import torch

    with torch.inference_mode():
        return module(torch.from_numpy(np.ascontiguousarray(samples))).numpy()


class StreamResampler:
    """Resamples a stream packet by packet to the samples of resampling it whole.

    With g = gcd(rate, target), output block b (target/g samples) reads input samples
    [b*n - width, (b+1)*n + width), n = rate/g (torchaudio's kernel). So each packet is run
    with the input before it that its first blocks read, and blocks whose input has not all
    arrived wait for the next packet (`width` samples: under a millisecond at the rates used
    here). `flush()` ends the stream: the last blocks read the zeros a whole-clip resample
    pads its end with; after it the resampler starts a new stream."""

    def __init__(self, rate: int, target: int):
        self.rate, self.target = rate, target
        if rate != target:
            module = _kernel(rate, target)
            g = math.gcd(rate, target)
            self._n_in, self._n_out = rate // g, target // g
            self._width = int(module.width)
            # [taps, n_out]: output block b is x[b*n_in - width : (b+1)*n_in + width] @ this
            self._taps = module.kernel[:, 0, :].T.numpy().copy()
            self._margin = -(-self._width // self._n_in) * self._n_in  # left context, whole blocks
        self.reset()

    def reset(self) -> None:
        if self.rate == self.target:
            return
        self._buf = np.zeros(self._margin, dtype=np.float32)  # a whole-clip resample's start padding
        self._buf_start = -self._margin  # stream index of _buf[0]
        self._next_block = 0
        self._seen = 0

    def push(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self.rate == self.target:
            return samples
        self._buf = np.concatenate([self._buf, samples])
        self._seen += len(samples)
        ready = max((self._seen - self._width) // self._n_in, 0)  # blocks whose input is all here
        return self._emit(ready)

    def flush(self) -> np.ndarray:
        """The rest of the stream, then a fresh start."""
        if self.rate == self.target:
            return np.zeros(0, dtype=np.float32)
        total = -(-self._n_out * self._seen // self._n_in)  # a whole-clip resample's length
        emitted = self._next_block * self._n_out
        out = self._emit(-(-total // self._n_out))[: max(total - emitted, 0)]
        self.reset()
        return out

    def _emit(self, stop_block: int) -> np.ndarray:
        blocks = stop_block - self._next_block
        if blocks <= 0:
            return np.zeros(0, dtype=np.float32)
        # the kernel as a matrix product over strided windows: the same sums as torchaudio's
        # conv1d without its per-call overhead, which dominated at one 20 ms packet per call
        lo = self._next_block * self._n_in - self._width - self._buf_start
        x = self._buf[lo:]
        need = (blocks - 1) * self._n_in + len(self._taps)
        if len(x) < need:  # flush: the zeros past the stream's end
            x = np.concatenate([x, np.zeros(need - len(x), dtype=np.float32)])
        windows = np.lib.stride_tricks.sliding_window_view(x[:need], len(self._taps))[:: self._n_in]
        out = (windows @ self._taps).reshape(-1)
        self._next_block = stop_block
        keep_from = stop_block * self._n_in - self._margin
        self._buf = self._buf[keep_from - self._buf_start :]
        self._buf_start = keep_from
        return out


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
