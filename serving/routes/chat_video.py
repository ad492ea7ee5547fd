"""`video_url` parts of chat messages: the video's bytes, checked before any stage decodes them.

A video is the cheapest bomb a client can send: a few kilobytes of MP4 can declare frames of
16k x 16k pixels, hours of duration at a near-zero bitrate, or tens of thousands of tiny
frames, and the vision stage holds every decoded frame as RGB. So the route reads the
container's header (declared size, duration, frame count), then demuxes and decodes the
stream once without converting frames, counting what it actually holds (a header can lie,
and a fragmented MP4 declares nothing) and stopping at the first limit passed or when the
decode time budget is spent. Only a video that passes goes to the pipeline (as its bytes).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

from omnistage.errors import InvalidRequestError
from omnistage.serving.routes.chat_models import VideoPart
from omnistage.serving.routes.served import UnsupportedError, invalid


class VideoTooLargeError(InvalidRequestError):
    status = 413
    code = "video_too_large"


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int = 64 << 20  # encoded size (the request body limit usually binds first)
    max_frame_pixels: int = 3840 * 2160  # one frame: 4K UHD
    max_seconds: float = 600.0
    max_frames: int = 7200  # 4 minutes at 30 frames/s; the model samples at most 768
    max_decoded_bytes: int = 1 << 30  # every frame as RGB: what the vision stage holds
    decode_seconds: float = 20.0  # wall time of the checking decode


LIMITS = VideoLimits()


def video_bytes(part: VideoPart, param: str, limits: VideoLimits = LIMITS) -> bytes:
    url = part.video_url.url
    if url.startswith(("http://", "https://", "file:")):
        raise UnsupportedError("video URLs are not fetched; send a data: URL (base64)", param=param)
    if not url.startswith("data:") or ";base64," not in url:
        raise invalid("video_url.url must be a data:video/...;base64,... URL", param, code="invalid_video_url")
    from omnistage.serving.routes.chat_input import decode_base64

    data = decode_base64(url.split(";base64,", 1)[1], param)
    check_video(data, param, limits)
    return data


def check_video(data: bytes, param: str, limits: VideoLimits = LIMITS) -> None:
    """Raise a 400/413 naming `param` when the video passes a limit or does not decode."""
    if len(data) > limits.max_bytes:
        raise VideoTooLargeError(f"{param} is {len(data)} bytes; a video may have at most {limits.max_bytes}", param)
    import av

    deadline = time.monotonic() + limits.decode_seconds
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise invalid(f"{param} has no video stream", param, code="invalid_video")
            stream = container.streams.video[0]
            _check_header(container, stream, param, limits)
            _check_decode(container, stream, param, limits, deadline)
    except InvalidRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - FFmpeg fails on hostile input in many ways: the input's fault
        raise invalid(f"{param} is not a decodable video: {exc}", param, code="invalid_video") from None


def _check_header(container, stream, param: str, limits: VideoLimits) -> None:
    width, height = stream.codec_context.width, stream.codec_context.height
    _check_size(width, height, param, limits)
    seconds = container.duration / 1_000_000 if container.duration else 0.0
    if stream.duration and stream.time_base:
        seconds = max(seconds, float(stream.duration * stream.time_base))
    _check_seconds(seconds, param, limits)
    if stream.frames > limits.max_frames:
        raise _too_many_frames(stream.frames, param, limits)
    if stream.frames * width * height * 3 > limits.max_decoded_bytes:
        raise _too_much_rgb(stream.frames, width, height, param, limits)


def _check_decode(container, stream, param: str, limits: VideoLimits, deadline: float) -> None:
    frames = pixels = 0
    for frame in container.decode(stream):
        frames += 1
        pixels += frame.width * frame.height
        _check_size(frame.width, frame.height, param, limits)
        if frame.time is not None:
            _check_seconds(frame.time, param, limits)
        if frames > limits.max_frames:
            raise _too_many_frames(frames, param, limits)
        if pixels * 3 > limits.max_decoded_bytes:
            raise _too_much_rgb(frames, frame.width, frame.height, param, limits)
        if time.monotonic() > deadline:
            message = f"{param} took more than {limits.decode_seconds:g} s to decode ({frames} frames so far)"
            raise invalid(message, param, code="video_too_complex")
    if frames == 0:
        raise invalid(f"{param} holds no video frames", param, code="invalid_video")


def _check_size(width: int, height: int, param: str, limits: VideoLimits) -> None:
    if width * height > limits.max_frame_pixels:
        message = f"{param} has {width}x{height} frames; a frame may have at most {limits.max_frame_pixels} pixels"
        raise invalid(message, param, code="video_resolution_too_large")


def _check_seconds(seconds: float, param: str, limits: VideoLimits) -> None:
    if seconds > limits.max_seconds:
        message = f"{param} lasts {seconds:.0f} s or more; a video may last at most {limits.max_seconds:g} s"
        raise invalid(message, param, code="video_too_long")


def _too_many_frames(frames: int, param: str, limits: VideoLimits) -> InvalidRequestError:
    message = f"{param} has {frames} frames or more; a video may have at most {limits.max_frames}"
    return invalid(message, param, code="video_too_many_frames")


def _too_much_rgb(frames: int, width: int, height: int, param: str, limits: VideoLimits) -> InvalidRequestError:
    message = (
        f"{param}: {frames} frames of {width}x{height} decode to more than {limits.max_decoded_bytes >> 20} MiB "
        "of RGB; send a shorter or smaller video"
    )
    return VideoTooLargeError(message, param)
