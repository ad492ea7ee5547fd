"""The `vision_encoder` stage: Qwen2.5-Omni's vision tower (images, videos) as a dynamic-batch stage.

A request carries one image or a list of them (encoded bytes, a path, a PIL image or an
[H, W, 3] uint8 array); its output `image_embeds` is a list with one entry per image, in
order: {"embeds": [tokens, hidden], "grid_thw": [t, h, w]} (the patch grid, which the thinker
needs for the placeholder count and the 3-D positions). `videos` likewise (encoded bytes, a path, or {"frames", "fps"}; frames
sampled, resized and cut into patches by stages/omni/video.py) gives `video_embeds`: one
{"embeds", "grid_thw", "second_per_grid"} per video.

Pixels are prepared with transformers' PIL-based Qwen2-VL image processor (resize to a
multiple of patch x merge within the pixel budget, normalise, cut into patches): it needs no
torchvision. The forward packs every image of every batched request into one call: the tower
attends within each image (window and full attention over per-image sequence offsets), so a
packed batch gives each image exactly what it gets alone.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.base import Port, StageContext, StageRequest
from omnistage.stages.dynamic import PreparedBatchEngine
from omnistage.stages.media_limits import open_image
from omnistage.stages.omni.checkpoint import load_submodule, read_config
from omnistage.stages.omni.video import VIDEO_FPS, VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, VideoPatcher, VideoPatches
from omnistage.stages.params import Param, ParamSet
from omnistage.stages.registry import register_stage

STAGE_PARAMS = ParamSet(
    "vision_encoder",
    (
        Param("weight_prefix", "string", "thinker.visual.", "Where the vision tower's weights live."),
        Param(
            "min_pixels",
            "integer",
            None,
            "Smallest image area after resizing (default: the checkpoint's preprocessor config, else 56*56).",
            minimum=1,
            nullable=True,
        ),
        Param(
            "max_pixels",
            "integer",
            None,
            "Largest image area after resizing (default: the checkpoint's preprocessor config, else 28*28*1280).",
            minimum=1,
            nullable=True,
        ),
        Param("video_min_pixels", "integer", VIDEO_MIN_PIXELS, "Smallest video frame area after resizing.", minimum=1),
        Param("video_max_pixels", "integer", VIDEO_MAX_PIXELS, "Largest video frame area after resizing.", minimum=1),
        Param(
            "video_fps",
            "number",
            VIDEO_FPS,
            "Video frames sampled per second (Qwen2.5-Omni's processor assumes 2).",
            exclusive_minimum=True,
            minimum=0,
        ),
    ),
)


def load_image(value: Any):
    """An RGB PIL image from bytes, a path, a PIL image or an [H, W, 3] uint8 array."""
    from PIL import Image

    try:
        if isinstance(value, Image.Image):
            img = value
        elif isinstance(value, (bytes, bytearray, str, Path)):
            img = open_image(value, "images")
        elif isinstance(value, (np.ndarray, torch.Tensor)):
            img = Image.fromarray(np.asarray(value, dtype=np.uint8))
        else:
            raise InvalidRequestError(f"an image cannot be a {type(value).__name__}", param="images")
        img.load()
    except InvalidRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - undecodable input is the request's fault
        raise InvalidRequestError(f"could not read the image ({exc.__class__.__name__})", param="images") from None
    return img.convert("RGB")


class ImagePatcher:
    """transformers' PIL Qwen2-VL image processor with the tower's patch geometry."""

    def __init__(self, vision_config: dict[str, Any], min_pixels: int, max_pixels: int):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.processor = Qwen2VLImageProcessorPil(
            patch_size=vision_config.get("patch_size", 14),
            temporal_patch_size=vision_config.get("temporal_patch_size", 2),
            merge_size=vision_config.get("spatial_merge_size", 2),
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        )

    def __call__(self, image) -> tuple[torch.Tensor, list[int]]:
        out = self.processor(images=[image], return_tensors="pt")
        return out["pixel_values"], [int(x) for x in out["image_grid_thw"][0]]


def _preprocessor_config(model_dir) -> dict[str, Any]:
    import json

    path = Path(model_dir) / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def build_vision_tower(model_dir: str, prefix: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniVisionEncoderConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

    raw = read_config(model_dir)["thinker_config"]["vision_config"]
    config = Qwen2_5OmniVisionEncoderConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    tower = Qwen2_5OmniVisionEncoder(config)
    return load_submodule(tower, model_dir, prefix).to(device=device, dtype=dtype)


def encode_images(tower: torch.nn.Module, patches: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]:
    """One packed forward: one [tokens, hidden] tensor per image."""
    weight = next(tower.parameters())
    packed = torch.cat(patches).to(device=weight.device, dtype=weight.dtype)
    grid = torch.tensor(grids, dtype=torch.long, device=weight.device)
    with torch.inference_mode():
        out = tower(packed, grid_thw=grid).pooler_output
    sizes = (grid.prod(-1) // tower.spatial_merge_size**2).tolist()
    return list(torch.split(out, sizes))


@register_stage("vision_encoder")
class VisionEncoderStage(PreparedBatchEngine):
    inputs = {"images": Port("image", optional=True), "videos": Port("video", optional=True)}
    outputs = {"image_embeds": Port("embeddings"), "video_embeds": Port("embeddings")}
    needs_model = True
    stage_params = STAGE_PARAMS
    prepare_errors = (InvalidRequestError,)

    def __init__(self, ctx: StageContext):
        super().__init__(ctx)
        if ctx.model_path is None:
            raise ValueError("vision_encoder needs a Qwen2.5-Omni model")
        params = STAGE_PARAMS.validate(ctx.params)
        vision_config = read_config(ctx.model_path)["thinker_config"]["vision_config"]
        pre = _preprocessor_config(ctx.model_path)
        min_pixels = params["min_pixels"] or pre.get("min_pixels") or 56 * 56
        max_pixels = params["max_pixels"] or pre.get("max_pixels") or 28 * 28 * 1280
        self.patcher = ImagePatcher(vision_config, min_pixels, max_pixels)
        self.video_patcher = VideoPatcher(
            vision_config, params["video_min_pixels"], params["video_max_pixels"], params["video_fps"]
        )
        self.tower = build_vision_tower(str(ctx.model_path), params["weight_prefix"], ctx.device, ctx.dtype)

    def prepare(self, request: StageRequest) -> tuple[list[Any], Hashable]:
        images = _items(request.inputs.get("images"))
        videos = _items(request.inputs.get("videos"))
        return [self.patcher(load_image(x)) for x in images] + [self.video_patcher(v) for v in videos], None

    def forward_batch(self, requests: list[StageRequest]) -> list[Any]:
        return self.forward_items(requests, self._encode, _outputs)

    def _encode(self, items: list[Any]) -> list[torch.Tensor]:
        patches = [i.patches if isinstance(i, VideoPatches) else i[0] for i in items]
        grids = [i.grid_thw if isinstance(i, VideoPatches) else i[1] for i in items]
        return encode_images(self.tower, patches, grids)


def _items(value: Any) -> list:
    if value is None:  # a request without this input: nothing to encode
        return []
    return value if isinstance(value, list) else [value]


def _outputs(items: list[Any], embeds: list[torch.Tensor]) -> dict[str, Any]:
    images, videos = [], []
    for item, e in zip(items, embeds):
        if isinstance(item, VideoPatches):
            videos.append({"embeds": e, "grid_thw": item.grid_thw, "second_per_grid": item.second_per_grid})
        else:
            images.append({"embeds": e, "grid_thw": item[1]})
    return {"image_embeds": images, "video_embeds": videos}
