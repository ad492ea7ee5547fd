"""Video frames -> MP4 (H.264, yuv420p) bytes with PyAV, whole or as an incremental fMP4 stream.

Frames are (T, H, W, C) uint8 (or float [0, 1]) with C = 3 (RGB) — torch or numpy. yuv420p
halves the chroma resolution, so H.264 needs even width and height: odd sizes are padded by
repeating the last row/column (`odd_size="pad"`, the default) or rejected (`odd_size="error"`).

`FragmentedMP4Muxer` writes a fragmented MP4 (`movflags=frag_keyframe+empty_moov`): the
header (ftyp + empty moov) comes first, then one moof+mdat fragment per pushed chunk. Each
chunk starts with a forced IDR frame and the encoder runs without lookahead, so a chunk's
fragment is complete — and returned — as soon as the next chunk starts or the stream closes.
Concatenating everything returned is a playable MP4 (browsers' MSE, ffmpeg, PyAV).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from fractions import Fraction
from typing import Any

import numpy as np

from omnistage.streaming.images import to_uint8

MP4_MEDIA_TYPE = "video/mp4"


def to_video_frames(frames: Any, *, odd_size: str = "pad") -> np.ndarray:
    """(T, H, W, 3) contiguous uint8 with even H and W (see module doc for `odd_size`)."""
    arr = to_uint8(frames)
    if arr.ndim == 3 and arr.shape[-1] == 3:
        arr = arr[None]  # one frame
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"video frames must be (T, H, W, 3) RGB; got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError("no frames to encode")
    _, h, w, _ = arr.shape
    if h % 2 or w % 2:
        if odd_size == "error":
            raise ValueError(f"H.264 yuv420p needs even frame sizes; got {w}x{h} (use odd_size='pad' to pad)")
        if odd_size != "pad":
            raise ValueError(f"odd_size must be 'pad' or 'error', not {odd_size!r}")
        arr = np.pad(arr, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    return np.ascontiguousarray(arr)


class _ChunkSink(io.RawIOBase):
    """A write-only file that hands out what was written since the last `take()`."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # forces the muxer into streaming mode: it never seeks back

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class FragmentedMP4Muxer:
    """Incremental H.264 fMP4 encoder: `push(frames) -> bytes`, then `close() -> bytes`.

    The frame size is fixed by the first chunk (after padding); later chunks must match.
    Also usable as a context manager. Not thread-safe: one producer per muxer.
    """

    def __init__(self, fps: float = 16.0, *, crf: int = 18, preset: str = "veryfast", odd_size: str = "pad"):
        if fps <= 0:
            raise ValueError("fps must be positive")
        self.fps = Fraction(fps).limit_denominator(1001)
        self.crf = crf
        self.preset = preset
        self.odd_size = odd_size
        self.frames_written = 0
        self._sink = _ChunkSink()
        self._container = None
        self._stream = None
        self._size: tuple[int, int] | None = None
        self._closed = False

    def _open(self, height: int, width: int) -> None:
        import av

        self._container = av.open(
            self._sink,
            mode="w",
            format="mp4",
            options={"movflags": "frag_keyframe+empty_moov+default_base_moof"},
        )
        stream = self._container.add_stream("libx264", rate=self.fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = 1 / self.fps
        # zerolatency: no lookahead / B-frames, so each frame's packet leaves the encoder at
        # once; forced-idr: the keyframe forced at each chunk start is a real IDR (a fragment
        # boundary for frag_keyframe).
        stream.options = {"crf": str(self.crf), "preset": self.preset, "tune": "zerolatency", "forced-idr": "1"}
        self._stream = stream
        self._size = (height, width)

    def push(self, frames: Any) -> bytes:
        """Encode a chunk of frames; returns the bytes that became final (may be empty)."""
        import av

        if self._closed:
            raise RuntimeError("muxer is closed")
        arr = to_video_frames(frames, odd_size=self.odd_size)
        _, h, w, _ = arr.shape
        if self._container is None:
            self._open(h, w)
        elif (h, w) != self._size:
            raise ValueError(f"frame size changed from {self._size[1]}x{self._size[0]} to {w}x{h}")
        for i, frame_array in enumerate(arr):
            frame = av.VideoFrame.from_ndarray(frame_array, format="rgb24")
            frame.pts = self.frames_written
            if i == 0:
                frame.pict_type = av.video.frame.PictureType.I
            self._container.mux(self._stream.encode(frame))
            self.frames_written += 1
        return self._sink.take()

    def close(self) -> bytes:
        """Flush the encoder and finish the file; returns the remaining bytes."""
        if self._closed:
            return b""
        self._closed = True
        if self._container is None:
            raise ValueError("no frames were pushed")
        self._container.mux(self._stream.encode(None))
        self._container.close()
        return self._sink.take()

    def __enter__(self) -> FragmentedMP4Muxer:
        return self

    def __exit__(self, *exc) -> None:
        if not self._closed and self._container is not None:
            try:
                self.close()
            except Exception:
                if exc[0] is None:
                    raise


def encode_mp4(
    frames: Any, fps: float = 16.0, *, crf: int = 18, preset: str = "veryfast", odd_size: str = "pad"
) -> bytes:
    """A whole (T, H, W, 3) clip as one MP4 file (H.264, yuv420p, fast-start friendly fMP4)."""
    muxer = FragmentedMP4Muxer(fps, crf=crf, preset=preset, odd_size=odd_size)
    return muxer.push(frames) + muxer.close()


def stream_mp4(chunks: Iterable[Any], fps: float = 16.0, **kwargs) -> Iterator[bytes]:
    """Yield fMP4 bytes while frame chunks arrive (for a StreamingResponse)."""
    muxer = FragmentedMP4Muxer(fps, **kwargs)
    for chunk in chunks:
        data = muxer.push(chunk)
        if data:
            yield data
    tail = muxer.close()
    if tail:
        yield tail
