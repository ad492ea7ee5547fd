"""The bytes of a /v1/audio/speech answer, made chunk by chunk as the waveform arrives.

- pcm: raw PCM16 little-endian mono at the pipeline's rate, each chunk as it is made;
- wav: a streaming WAV header (length unknown, streaming/audio.py) and then the same PCM16;
- mp3, opus (Ogg), aac (ADTS): encoded as the audio arrives (PyAV), each piece sent as soon
  as the muxer has written it (an encoder holds back a frame or so of audio);
- flac: the whole clip encoded once it is complete (streaming/audio.py): its header carries
  the stream's length and checksum, written by seeking back at the end.
`speed` other than 1 runs the audio through FFmpeg's atempo filter (PyAV), which changes the
duration and keeps the pitch; it works on the chunks as they come, so streaming keeps going.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omnistage.streaming.audio import encode_audio, to_pcm16, to_pcm16_array, wav_stream_header

STREAMED_FORMATS = ("pcm", "wav")
ENCODED_AS_MADE = ("mp3", "opus", "aac")


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


class CodecStream:
    """A PyAV muxer writing into memory; each call returns the bytes written since the last."""

    def __init__(self, fmt: str, rate: int):
        import io

        import av

        from omnistage.streaming.audio import AUDIO_CODECS

        container_fmt, codec_name, _ = AUDIO_CODECS[fmt]
        codec = av.codec.Codec(codec_name, "w")
        rates = sorted(codec.audio_rates or [])
        out_rate = rate if not rates or rate in rates else next((r for r in rates if r >= rate), rates[-1])
        self.rate = rate
        self.buf = io.BytesIO()
        self.sent = 0
        self.container = av.open(self.buf, mode="w", format=container_fmt)
        self.stream = self.container.add_stream(codec_name, rate=out_rate, layout="mono")
        self.stream.bit_rate = 64_000 if fmt == "opus" else 128_000
        self.resampler = av.AudioResampler(format=codec.audio_formats[0].name, layout="mono", rate=out_rate)

    def _new_bytes(self) -> bytes:
        data = self.buf.getvalue()[self.sent :]
        self.sent += len(data)
        return data

    def feed(self, samples: np.ndarray) -> bytes:
        import av

        pcm = to_pcm16_array(samples).reshape(1, -1)
        if not pcm.size:
            return b""
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm), format="s16", layout="mono")
        frame.sample_rate = self.rate
        for chunk in self.resampler.resample(frame):
            self.container.mux(self.stream.encode(chunk))
        return self._new_bytes()

    def finish(self) -> bytes:
        for chunk in self.resampler.resample(None):
            self.container.mux(self.stream.encode(chunk))
        self.container.mux(self.stream.encode(None))
        self.container.close()
        return self._new_bytes()


class SpeechEncoder:
    """feed(chunk) -> bytes to send now; finish() -> the rest."""

    def __init__(self, fmt: str, rate: int, speed: float = 1.0):
        self.fmt = fmt
        self.rate = rate
        self.tempo = Tempo(rate, speed) if speed != 1.0 else None
        self.header_sent = False
        self.codec = CodecStream(fmt, rate) if fmt in ENCODED_AS_MADE else None
        self.held: list[np.ndarray] = []  # flac: the whole clip

    def _bytes(self, samples: np.ndarray) -> bytes:
        if self.codec is not None:
            return self.codec.feed(samples)
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
        if self.codec is not None:
            return out + self.codec.finish()
        if self.fmt in STREAMED_FORMATS:
            return out
        clip = np.concatenate(self.held) if self.held else np.zeros(0, np.float32)
        return encode_audio(clip, self.rate, self.fmt)
