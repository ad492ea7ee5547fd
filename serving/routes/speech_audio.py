"""The bytes of a /v1/audio/speech answer, made chunk by chunk as the waveform arrives.

- pcm: raw PCM16 little-endian mono at the pipeline's rate, each chunk as it is made;
- wav: a streaming WAV header (length unknown, streaming/audio.py) and then the same PCM16;
- flac, mp3, opus, aac: the whole clip encoded once it is complete (streaming/audio.py), since
  these containers are written with their headers knowing the stream.
`speed` other than 1 runs the audio through FFmpeg's atempo filter (PyAV), which changes the
duration and keeps the pitch; it works on the chunks as they come, so streaming keeps going.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omnistage.streaming.audio import encode_audio, to_pcm16, wav_stream_header

STREAMED_FORMATS = ("pcm", "wav")


class Tempo:
    """atempo over a mono float stream (one filter takes 0.5-2.0; larger changes chain them)."""

    def __init__(self, rate: int, speed: float):
        from av.filter import Graph

        self.rate = rate
        self.pts = 0
        self.graph = Graph()
        nodes = [self.graph.add_abuffer(format="flt", sample_rate=rate, layout="mono", time_base=f"1/{rate}")]
        for factor in _tempo_factors(speed):
            nodes.append(self.graph.add("atempo", f"{factor:.6f}"))
        nodes.append(self.graph.add("abuffersink"))
        self.graph.link_nodes(*nodes).configure()

    def feed(self, samples: np.ndarray | None) -> np.ndarray:
        """Push samples (None: the end) and return what the filter has ready."""
        import av

        if samples is None:
            self.graph.push(None)
        elif len(samples):
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt", layout="mono")
            frame.sample_rate, frame.pts = self.rate, self.pts
            self.pts += len(samples)
            self.graph.push(frame)
        out = []
        while True:
            try:
                out.append(self.graph.pull().to_ndarray().reshape(-1))
            except (av.BlockingIOError, av.EOFError):
                break
        return np.concatenate(out) if out else np.zeros(0, np.float32)


def _tempo_factors(speed: float) -> list[float]:
    factors = []
    while speed > 2.0:
        factors.append(2.0)
        speed /= 2.0
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    return [*factors, speed]


class SpeechEncoder:
    """feed(chunk) -> bytes to send now; finish() -> the rest."""

    def __init__(self, fmt: str, rate: int, speed: float = 1.0):
        self.fmt = fmt
        self.rate = rate
        self.tempo = Tempo(rate, speed) if speed != 1.0 else None
        self.header_sent = False
        self.held: list[np.ndarray] = []  # compressed formats: the whole clip

    def _bytes(self, samples: np.ndarray) -> bytes:
        if self.fmt not in STREAMED_FORMATS:
            self.held.append(samples)
            return b""
        out = b""
        if self.fmt == "wav" and not self.header_sent:
            out, self.header_sent = wav_stream_header(self.rate), True
        return out + (to_pcm16(samples) if len(samples) else b"")

    def feed(self, chunk: Any) -> bytes:
        samples = np.asarray(chunk, dtype=np.float32).reshape(-1)
        if self.tempo is not None:
            samples = self.tempo.feed(samples)
        return self._bytes(samples)

    def finish(self) -> bytes:
        tail = self.tempo.feed(None) if self.tempo is not None else np.zeros(0, np.float32)
        out = self._bytes(tail)
        if self.fmt in STREAMED_FORMATS:
            return out
        clip = np.concatenate(self.held) if self.held else np.zeros(0, np.float32)
        return encode_audio(clip, self.rate, self.fmt)
