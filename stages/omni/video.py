"""Video input for Qwen2.5-Omni without torchvision: PyAV decoding, frame sampling, patches.

transformers' Qwen2-VL video processor needs torchvision, which this project does not install
(stages/omni/inputs.py says why). Its steps are small and are done here:
- frames sampled at 2 per second (the rate Qwen2.5-Omni's processor assumes when it sets
  `video_second_per_grid = temporal_patch_size / 2`), with the video processor's
  `sample_frames` arithmetic: a multiple of temporal_patch_size, at least 4 where the video
  has them, indices `arange(0, total, total / n)`;
- every frame resized to the same `smart_resize` size (a multiple of patch x merge within
  the video pixel budget, 128·28² to 768·28² by default) with Pillow's bicubic filter, as the
  image processor resizes (torchvision's tensor resize differs from it in rounding only),
  rescaled to [0, 1] and normalised with the CLIP mean / std;
- patches cut as the video processor's `patchify` cuts them: frames grouped in pairs along
  time (the last frame repeated to fill a pair), each patch row holding
  [channel, time, patch_y, patch_x] for one merged-patch position.
Encoded videos decode within the bounds of stages/media_limits.py (frame size and count,
duration, bytes of RGB), whichever way they arrive.
tests/omni/test_video.py checks the resize, normalisation and patch layout against
transformers' PIL image processor on the frames (a still image is a video of two equal frames).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.media_limits import VIDEO_LIMITS, check_video, decode_video, read_bounded, video_header

VIDEO_FPS = 2.0
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
MIN_FRAMES, MAX_FRAMES = 4, 768
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class VideoPatches:
    """One video ready for the vision tower."""

    patches: torch.Tensor  # [t * h * w, 3 * temporal_patch_size * patch * patch]
    grid_thw: list[int]
    second_per_grid: float  # seconds one temporal patch covers


def load_frames(value: Any, pick: Callable[[int, float], np.ndarray] | None = None) -> tuple[np.ndarray, float]:
    """[N, H, W, 3] uint8 frames and their rate from encoded bytes, a path, or
    {"frames": [N, H, W, 3] uint8, "fps": rate}. With `pick` (total, rate -> indices) only those
    frames are returned; an encoded video is then counted first and decoded keeping only them."""
    if isinstance(value, dict):
        if "frames" not in value or "fps" not in value:
            raise InvalidRequestError("raw video needs 'frames' and 'fps'", param="videos")
        frames = np.asarray(value["frames"])
        if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
            raise InvalidRequestError("video frames must be a non-empty [N, H, W, 3] array", param="videos")
        try:
            rate = float(value["fps"])
        except (TypeError, ValueError):
            rate = math.nan
        if not math.isfinite(rate) or rate <= 0:
            raise InvalidRequestError(f"fps must be a positive number, got {value['fps']!r}", param="videos")
        if pick is not None:
            frames = frames[pick(len(frames), rate)]
        return frames.astype(np.uint8, copy=False), rate
    if isinstance(value, (str, Path)):
        value = read_bounded(value, VIDEO_LIMITS.max_bytes, "videos")
    if not isinstance(value, (bytes, bytearray)):
        raise InvalidRequestError("a video must be encoded bytes, a path or {frames, fps}", param="videos")
    raw = bytes(value)
    if pick is None:
        frames, probe = decode_video(raw, "videos")
        return np.stack(frames), probe.rate
    # one decode when the header's frame count holds; else the count a decode found, and the
    # picks decoded again from it
    probe = video_header(raw, "videos")
    if not (probe.frames and probe.rate):
        probe = check_video(raw, "videos")
    frames, found = decode_video(raw, "videos", keep={int(i) for i in pick(probe.frames, probe.rate)})
    if found.frames != probe.frames:  # the header's count was wrong
        frames, found = decode_video(raw, "videos", keep={int(i) for i in pick(found.frames, found.rate)})
    return np.stack(frames), found.rate


def sample_indices(total: int, video_fps: float, fps: float, temporal_patch_size: int) -> np.ndarray:
    """Frame indices sampled at `fps` (transformers' sample_frames arithmetic); a video shorter
    than one temporal patch keeps every frame."""
    tps = temporal_patch_size
    most = math.floor(min(MAX_FRAMES, total) / tps) * tps
    n = min(max(total / video_fps * fps, MIN_FRAMES), most, total)
    n = math.floor(n / tps) * tps
    if n <= 0:
        return np.arange(total)
    return torch.arange(0, total, total / n).int().numpy()


def patchify(video: torch.Tensor, patch: int, merge: int, tps: int) -> tuple[torch.Tensor, list[int]]:
    """[frames, 3, H, W] -> [t * h * w, 3 * tps * patch²] rows (the video processor's layout)."""
    if pad := -video.shape[0] % tps:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    frames, channels, height, width = video.shape
    t, h, w = frames // tps, height // patch, width // patch
    x = video.view(t, tps, channels, h // merge, merge, patch, w // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, channels * tps * patch * patch), [t, h, w]


class VideoPatcher:
    """Frames -> normalised patches with the tower's geometry."""

    def __init__(self, vision_config: dict[str, Any], min_pixels: int, max_pixels: int, fps: float = VIDEO_FPS):
        self.patch = int(vision_config.get("patch_size", 14))
        self.tps = int(vision_config.get("temporal_patch_size", 2))
        self.merge = int(vision_config.get("spatial_merge_size", 2))
        self.min_pixels, self.max_pixels, self.fps = min_pixels, max_pixels, fps

    def __call__(self, value: Any) -> VideoPatches:
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        frames, _ = load_frames(value, lambda total, rate: sample_indices(total, rate, self.fps, self.tps))
        height, width = frames.shape[1:3]
        try:
            rh, rw = smart_resize(height, width, self.patch * self.merge, self.min_pixels, self.max_pixels)
        except ValueError as exc:
            raise InvalidRequestError(f"bad video size: {exc}", param="videos") from None
        resized = np.stack([np.asarray(Image.fromarray(f).resize((rw, rh), Image.Resampling.BICUBIC)) for f in frames])
        x = torch.from_numpy(resized).float().permute(0, 3, 1, 2) / 255.0
        x = (x - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)
        patches, grid = patchify(x, self.patch, self.merge, self.tps)
        return VideoPatches(patches, grid, self.tps / self.fps)
