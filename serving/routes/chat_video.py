"""`video_url` parts of chat messages: the video's bytes, checked before the answer starts.

A video is the cheapest bomb a client can send (a few kilobytes of MP4 can declare hours of
4K frames), so the route runs the checking decode of stages/media_limits.py on it first:
a video past a limit is a 400/413 naming its field, before any stage sees it. Only a video
that passes goes to the pipeline (as its bytes; the vision stage decodes it with the same
bounds).
"""

from __future__ import annotations

from omnistage.serving.routes.chat_models import VideoPart
from omnistage.serving.routes.served import UnsupportedError, invalid
from omnistage.stages.media_limits import VIDEO_LIMITS, VideoLimits, check_video


def video_bytes(part: VideoPart, param: str, limits: VideoLimits = VIDEO_LIMITS) -> bytes:
    url = part.video_url.url
    if url.startswith(("http://", "https://", "file:")):
        raise UnsupportedError("video URLs are not fetched; send a data: URL (base64)", param=param)
    if not url.startswith("data:") or ";base64," not in url:
        raise invalid("video_url.url must be a data:video/...;base64,... URL", param, code="invalid_video_url")
    from omnistage.serving.routes.chat_input import decode_base64

    data = decode_base64(url.split(";base64,", 1)[1], param)
    check_video(data, param, limits)
    return data
