"""A running job's media while it is produced: the video as fragmented-MP4 segments muxed while
the VAE decodes chunks (LiveVideo), the audio as PCM16 chunks as the vocoder emits them (LiveAudio).

The scheduler pushes each chunk of frames the pipeline streams on a video port (MP4 format)
into a FragmentedMP4Muxer; the bytes each push completes are a segment. Websocket clients of
`/v1/jobs/{id}/stream` read the segments list from the start, and the finished job's file is
their concatenation, so a client that plays the stream and one that downloads the file see
the same frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omnistage.streaming.video import FragmentedMP4Muxer


@dataclass
class LiveVideo:
    port: str
    fps: float
    segments: list[bytes] = field(default_factory=list)
    done: bool = False
    _muxer: FragmentedMP4Muxer | None = None

    def push(self, frames: Any) -> bool:
        """Encode one chunk of frames; True when a new segment is ready."""
        if self._muxer is None:
            self._muxer = FragmentedMP4Muxer(self.fps)
        data = self._muxer.push(frames)
        if data:
            self.segments.append(data)
        return bool(data)

    def finish(self) -> bytes:
        """Close the muxer; returns the whole file (every segment, in order). `done` is set by
        the scheduler once the job's end is stored, so a client never sees the stream end first."""
        if self._muxer is not None:
            muxer, self._muxer = self._muxer, None
            tail = muxer.close()
            if tail:
                self.segments.append(tail)
        return b"".join(self.segments)


@dataclass
class LiveAudio:
    """A running job's audio as binary chunks while the vocoder emits them: for `wav`, a WAV
    header of unknown length first (streaming WAV), then raw PCM16 per chunk; for `pcm`, the raw
    PCM16 only. The samples are those of the finished file (the same PCM16 rounding)."""

    port: str
    sample_rate: int
    fmt: str = "wav"
    segments: list[bytes] = field(default_factory=list)
    done: bool = False

    def push(self, samples: Any) -> bool:
        from omnistage.streaming.audio import to_pcm16, wav_stream_header

        data = to_pcm16(samples)
        if not data:
            return False
        if not self.segments and self.fmt == "wav":
            data = wav_stream_header(self.sample_rate) + data
        self.segments.append(data)
        return True

    def finish(self) -> None:
        """The finished file is written from the whole clip (with its real length); a wav stream
        that got no audio (a talker may end at its first step) still gets its header, so every
        listener has a WAV. `done` is set by the scheduler once the job's end is stored."""
        from omnistage.streaming.audio import wav_stream_header

        if not self.segments and self.fmt == "wav":
            self.segments.append(wav_stream_header(self.sample_rate))
