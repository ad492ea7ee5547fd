"""MP4 bombs made here with PyAV (huge declared frames, long duration at a near-zero bitrate,
thousands of frames, gigabytes of RGB from kilobytes), sent as video_url parts with the
official `openai` client to a live tiny-omni server: each is refused with a clear 400/413
before its decoding runs away, a normal video right after succeeds, and the server's peak RSS
stays bounded."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from omnistage.stages.media_limits import VideoLimits, check_video
from omnistage.tests.reliability.media_bombs import peak_rss, repeated_mp4

from .test_chat_video import VIDEO, encode_mp4, video_message


def _server_peak(pid: int) -> int:
    return peak_rss(pid)[pid]


BOMBS = {
    # 4096 x 2304 (over 4K UHD's pixels) in a few kilobytes
    "resolution": (
        lambda: encode_mp4(np.zeros((1, 2304, 4096, 3), np.uint8), fps=1),
        400,
        "video_resolution_too_large",
    ),
    # three 16 x 16 frames 350 s apart: 700 s of video at a near-zero bitrate
    "duration": (
        lambda: encode_mp4(np.zeros((3, 16, 16, 3), np.uint8), fps=1, pts=[0, 350, 700]),
        400,
        "video_too_long",
    ),
    # 7,300 tiny frames, found while decoding (the header declares none)
    "frames": (lambda: repeated_mp4(16, 16, 7300, 30), 400, "video_too_many_frames"),
    # 180 frames of 1080p: 1.1 GiB of RGB from 30 kB, found while decoding
    "rgb": (lambda: repeated_mp4(1080, 1920, 180, 24), 413, "video_too_large"),
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_mp4_bombs_are_refused_and_the_server_stays_healthy(omni, omni_server, name):
    make, status, code = BOMBS[name]
    raw = make()
    assert len(raw) < 2 << 20, len(raw)  # small on the wire
    before = _server_peak(omni_server.proc.pid)
    with pytest.raises(openai.APIStatusError) as info:
        omni.chat.completions.create(model="tiny-omni", messages=video_message(raw), max_tokens=2)
    assert info.value.status_code == status
    assert info.value.body["code"] == code, info.value.body
    assert info.value.body["param"] == "messages[0].content[0].video_url"
    growth_mb = (_server_peak(omni_server.proc.pid) - before) / (1 << 20)
    assert growth_mb < 300, f"peak RSS grew {growth_mb:.0f} MB while refusing the {name} bomb"
    ok = omni.chat.completions.create(model="tiny-omni", messages=video_message(VIDEO), max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_byte_and_decode_time_limits():
    """The limits the server's defaults make costly to reach, on the same checking code."""
    with pytest.raises(Exception) as info:
        check_video(VIDEO, "v", VideoLimits(max_bytes=len(VIDEO) - 1))
    assert (info.value.status, info.value.code) == (413, "video_too_large")
    with pytest.raises(Exception) as info:
        check_video(VIDEO, "v", VideoLimits(decode_seconds=0.0))
    assert (info.value.status, info.value.code) == (400, "video_too_complex")
    check_video(VIDEO, "v")  # the default limits take it
