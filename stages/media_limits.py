"""Bounds on what an encoded media input may decode to, checked before the memory is spent.

A few kilobytes can declare a 50,000² image, an hour of audio at 1 Hz (resampled to 16 kHz:
16,000 times its samples), or an MP4 of tens of thousands of frames. The chat route checks a
request's media with these functions before it starts an answer (a 400/413 naming the field);
the stages decode with the same bounds, so media given through the Python API or a
pipeline's own inputs are held to them too.

Videos: the container's header is read first (declared size, duration, frame count), then the
stream is demuxed and decoded counting what it actually holds (a header can lie, and a
fragmented MP4 declares nothing), stopping at the first limit passed or when the decode time
budget is spent; only the frames the caller keeps become RGB arrays (the vision stage counts
first, then keeps the frames it samples).
"""

from __future__ import annotations

import io
import os
import stat
import time
from collections.abc import Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnistage.errors import InvalidRequestError, VideoTooLargeError

MAX_IMAGE_PIXELS = 1 << 26  # 64 Mpx (8192 x 8192): decoded RGB stays under 200 MB
AUDIO_RATE_RANGE = (4_000, 384_000)  # Hz: telephone audio to studio audio
MAX_AUDIO_SECONDS = 20 * 60  # an hour would decode to ~230 MB
MAX_AUDIO_BYTES = 256 << 20  # encoded: 20 minutes of 48 kHz stereo 16-bit WAV fit


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int = 64 << 20  # encoded size (the request body limit usually binds first)
    max_frame_pixels: int = 3840 * 2160  # one frame: 4K UHD
    max_seconds: float = 600.0
    max_frames: int = 7200  # 4 minutes at 30 frames/s; the model samples at most 768
    max_decoded_bytes: int = 1 << 30  # every frame as RGB: what the vision stage holds
    decode_seconds: float = 20.0  # wall time of the decode


VIDEO_LIMITS = VideoLimits()


def read_bounded(path: str | Path, max_bytes: int, param: str) -> bytes:
    """A file's bytes, refused past `max_bytes` before they are read: a regular file by its
    size, a device (/dev/zero reports size 0 and never ends) by reading one byte over."""
    try:
        kind = os.stat(path)
        if not (stat.S_ISREG(kind.st_mode) or stat.S_ISCHR(kind.st_mode)):  # a FIFO would block
            raise InvalidRequestError(f"{param}: {str(path)!r} is not a file", param=param)
        if kind.st_size > max_bytes:
            raise InvalidRequestError(
                f"{param} is {kind.st_size} bytes; at most {max_bytes}", param, code="input_too_large"
            )
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise InvalidRequestError(f"cannot read {param} from {str(path)!r}: {exc}", param=param) from None
    if len(data) > max_bytes:
        raise InvalidRequestError(f"{param} is larger than {max_bytes} bytes", param, code="input_too_large")
    return data


def check_image_size(width: int, height: int, param: str) -> None:
    if width * height > MAX_IMAGE_PIXELS:
        message = f"{param} is {width}x{height} pixels; images may have at most {MAX_IMAGE_PIXELS} pixels"
        raise InvalidRequestError(message, param, code="image_too_large")


def image_problem(exc: BaseException) -> str:
    """Why Pillow could not read an image, in words for the client (Pillow's own message for
    an unknown format names the BytesIO object it was given)."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "its format is not one the server reads (PNG, JPEG, WebP, GIF, BMP, TIFF, ...)"
    return str(exc)


def open_image(source: bytes | bytearray | str | Path, param: str):
    """A Pillow image opened from encoded bytes or a path, its declared size checked against
    MAX_IMAGE_PIXELS from the header, before any pixel is decoded."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
    except Image.DecompressionBombError as exc:  # a size so large Pillow refuses to open it
        raise InvalidRequestError(f"{param} declares too many pixels: {exc}", param, code="image_too_large") from None
    try:
        check_image_size(img.width, img.height, param)
    except InvalidRequestError:
        img.close()
        raise
    return img


def check_audio_size(rate: int, seconds: float, param: str) -> None:
    low, high = AUDIO_RATE_RANGE
    if not low <= rate <= high:
        message = f"{param} has a sample rate of {rate} Hz; audio input must be sampled at {low}-{high} Hz"
        raise InvalidRequestError(message, param, code="invalid_sample_rate")
    if seconds > MAX_AUDIO_SECONDS:
        message = f"{param} lasts {seconds:.0f} s; audio input may last at most {MAX_AUDIO_SECONDS} s"
        raise InvalidRequestError(message, param, code="audio_too_long")


@dataclass(frozen=True)
class VideoProbe:
    """What the checking decode found: the frames the first video stream really holds."""

    frames: int
    rate: float


def check_video(data: bytes, param: str, limits: VideoLimits = VIDEO_LIMITS) -> VideoProbe:
    """Raise a 400/413 naming `param` when the video passes a limit or does not decode; no
    frame is converted or kept."""
    return decode_video(data, param, limits, keep=())[1]


def video_header(data: bytes, param: str, limits: VideoLimits = VIDEO_LIMITS) -> VideoProbe:
    """What the container's header declares (frames 0 when it does not say), checked against
    `limits`; nothing is decoded."""
    with _opened_video(data, param, limits) as (_, stream):
        return VideoProbe(int(stream.frames), _frame_rate(stream))


def decode_video(
    data: bytes, param: str, limits: VideoLimits = VIDEO_LIMITS, keep: Container[int] | None = None
) -> tuple[list[np.ndarray], VideoProbe]:
    """The first video stream's frames whose index is in `keep` (every frame when None) as
    [H, W, 3] uint8 arrays, and what the stream holds, within `limits`."""
    deadline = time.monotonic() + limits.decode_seconds
    with _opened_video(data, param, limits) as (container, stream):
        frames, count = _decode(container, stream, param, limits, deadline, keep)
        rate = _frame_rate(stream)
    if not rate:
        raise InvalidRequestError(f"{param} declares no frame rate", param, code="invalid_video")
    return frames, VideoProbe(count, rate)


@contextmanager
def _opened_video(data: bytes, param: str, limits: VideoLimits) -> Iterator[tuple[Any, Any]]:
    """The container and its first video stream, the header checked against `limits`. FFmpeg
    fails on hostile input in many ways, here or while the caller decodes: all are the input's
    fault (invalid_video)."""
    if len(data) > limits.max_bytes:
        raise VideoTooLargeError(f"{param} is {len(data)} bytes; a video may have at most {limits.max_bytes}", param)
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise InvalidRequestError(f"{param} has no video stream", param, code="invalid_video")
            stream = container.streams.video[0]
            _check_header(container, stream, param, limits)
            yield container, stream
    except InvalidRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - see above
        raise InvalidRequestError(f"{param} is not a decodable video: {exc}", param, code="invalid_video") from None


def _frame_rate(stream) -> float:
    return float(stream.average_rate or stream.guessed_rate or 0)


def _check_header(container, stream, param: str, limits: VideoLimits) -> None:
    width, height = stream.codec_context.width, stream.codec_context.height
    _check_frame_size(width, height, param, limits)
    seconds = container.duration / 1_000_000 if container.duration else 0.0
    if stream.duration and stream.time_base:
        seconds = max(seconds, float(stream.duration * stream.time_base))
    _check_seconds(seconds, param, limits)
    if stream.frames > limits.max_frames:
        raise _too_many_frames(stream.frames, param, limits)
    if stream.frames * width * height * 3 > limits.max_decoded_bytes:
        raise _too_much_rgb(stream.frames, width, height, param, limits)


def _decode(
    container, stream, param: str, limits: VideoLimits, deadline: float, keep: Container[int] | None
) -> tuple[list[np.ndarray], int]:
    kept: list[np.ndarray] = []
    frames = pixels = 0
    for frame in container.decode(stream):
        frames += 1
        pixels += frame.width * frame.height
        _check_frame_size(frame.width, frame.height, param, limits)
        if frame.time is not None:
            _check_seconds(frame.time, param, limits)
        if frames > limits.max_frames:
            raise _too_many_frames(frames, param, limits)
        if pixels * 3 > limits.max_decoded_bytes:
            raise _too_much_rgb(frames, frame.width, frame.height, param, limits)
        if time.monotonic() > deadline:
            message = f"{param} took more than {limits.decode_seconds:g} s to decode ({frames} frames so far)"
            raise InvalidRequestError(message, param, code="video_too_complex")
        if keep is None or frames - 1 in keep:
            kept.append(frame.to_ndarray(format="rgb24"))
    if frames == 0:
        raise InvalidRequestError(f"{param} holds no video frames", param, code="invalid_video")
    return kept, frames


def _check_frame_size(width: int, height: int, param: str, limits: VideoLimits) -> None:
    if width * height > limits.max_frame_pixels:
        message = f"{param} has {width}x{height} frames; a frame may have at most {limits.max_frame_pixels} pixels"
        raise InvalidRequestError(message, param, code="video_resolution_too_large")


def _check_seconds(seconds: float, param: str, limits: VideoLimits) -> None:
    if seconds > limits.max_seconds:
        message = f"{param} lasts {seconds:.0f} s or more; a video may last at most {limits.max_seconds:g} s"
        raise InvalidRequestError(message, param, code="video_too_long")


def _too_many_frames(frames: int, param: str, limits: VideoLimits) -> InvalidRequestError:
    message = f"{param} has {frames} frames or more; a video may have at most {limits.max_frames}"
    return InvalidRequestError(message, param, code="video_too_many_frames")


def _too_much_rgb(frames: int, width: int, height: int, param: str, limits: VideoLimits) -> InvalidRequestError:
    message = (
        f"{param}: {frames} frames of {width}x{height} decode to more than {limits.max_decoded_bytes >> 20} MiB "
        "of RGB; send a shorter or smaller video"
    )
    return VideoTooLargeError(message, param)
