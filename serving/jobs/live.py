"""A running job's video as fragmented-MP4 segments, muxed while the VAE decodes chunks.

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
        """Close the muxer; returns the whole file (every segment, in order)."""
        if self._muxer is not None and not self.done:
            tail = self._muxer.close()
            if tail:
                self.segments.append(tail)
        self.done = True
        return b"".join(self.segments)
