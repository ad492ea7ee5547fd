"""Stage kind `vae_decoder`: latents -> pixels, dynamic batching (DynamicBatchEngine).

Requests whose latents the adapter says can share a call (equal `batch_key`) decode together,
up to max_batch_size requests per call. Requests with key None (video) decode alone through
`decode_chunks`, one chunk per engine step, so the first frames leave before the whole video
is decoded. Output: `image` [n, H, W, 3] (or `video` [n, F, H, W, 3] chunks along F when the
stage param `output: video`), uint8 or float ([0,1]) per the request's `output_type`.
"""

from __future__ import annotations

from typing import Any

import torch

from omnistage.stages.base import Port, StageRequest
from omnistage.stages.diffusion.adapters.base import GENERATION_PARAMS, LOADING_PARAMS, GenerationParams, to_output
from omnistage.stages.diffusion.loading import build_adapter
from omnistage.stages.dynamic import PreparedBatchEngine
from omnistage.stages.params import Param, ParamSet
from omnistage.stages.registry import register_stage

STAGE_PARAMS = ParamSet(
    "vae_decoder",
    LOADING_PARAMS
    + (
        Param(
            "output",
            "string",
            "image",
            "Output port: image [n, H, W, 3] or video [n, F, H, W, 3] (streamed).",
            choices=("image", "video"),
        ),
        Param("tiling", "boolean", False, "Decode in overlapping spatial tiles."),
        Param(
            "tile_latent_size",
            "integer",
            None,
            "Tile size in latent pixels; default: the VAE's.",
            minimum=2,
            nullable=True,
        ),
        Param("tile_overlap", "number", 0.25, "Tile overlap fraction.", minimum=0, maximum=1, exclusive_maximum=True),
        Param("slicing", "boolean", False, "Decode one sample of a batch at a time."),
        Param(
            "auto_tile_pixels", "integer", None, "Tile outputs with more pixels than this.", minimum=1, nullable=True
        ),
        Param("chunk_latent_frames", "integer", 1, "Video: latent frames per streamed chunk.", minimum=1),
        Param("tile_sample_size", "integer", None, "Video tiling: tile size in pixels.", minimum=1, nullable=True),
        Param("tile_sample_stride", "integer", None, "Video tiling: tile stride in pixels.", minimum=1, nullable=True),
    ),
)


@register_stage("vae_decoder")
class VaeDecoderStage(PreparedBatchEngine):
    inputs = {"latents": Port("latents")}
    outputs = {"image": Port("image")}
    needs_model = True
    stage_params = STAGE_PARAMS
    request_params = GENERATION_PARAMS

    @classmethod
    def ports(cls, params: dict[str, Any]):
        if (params or {}).get("output") == "video":
            return dict(cls.inputs), {"video": Port("video", streaming=True)}
        return dict(cls.inputs), dict(cls.outputs)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.adapter = build_adapter(ctx, "VAE", extra_args=(dict(ctx.params or {}),))
        self.port = next(iter(self.ports(ctx.params)[1]))

    def prepare(self, request: StageRequest) -> tuple:
        """(params, batch key, decode alone?)."""
        params = GenerationParams.from_dict(request.params)
        latents = request.inputs.get("latents")
        if not isinstance(latents, torch.Tensor):
            raise ValueError("vae_decoder request without latents")
        key = self.adapter.batch_key(latents, params)
        return (params, ("alone", request.request_id) if key is None else key, key is None)

    def forward_batch(self, requests: list[StageRequest]) -> list[Any]:
        parsed = [self._parsed.pop(r.request_id, None) for r in requests]
        results: list[Any] = [None] * len(requests)
        batch = []
        for i, (req, p) in enumerate(zip(requests, parsed)):
            if not isinstance(p, tuple):
                results[i] = p if p is not None else RuntimeError("request state lost")
            elif p[2]:  # chunked: an iterator, one chunk per engine step
                results[i] = self._chunks(req.inputs["latents"], p[0])
            else:
                batch.append(i)
        if batch:
            latents = torch.cat([requests[i].inputs["latents"] for i in batch])
            pixels = self.adapter.decode_batch(latents)
            offset = 0
            for i in batch:
                n = int(requests[i].inputs["latents"].shape[0])
                results[i] = {self.port: to_output(pixels[offset : offset + n], parsed[i][0].output_type)}
                offset += n
        return results

    def _chunks(self, latents: torch.Tensor, params: GenerationParams):
        for chunk in self.adapter.decode_chunks(latents, params):
            yield {self.port: to_output(chunk, params.output_type)}
