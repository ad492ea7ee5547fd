"""What a diffusion request may ask of this server, and checking it before the request runs.

`RequestCaps` are the denoiser's stage params that bound one request (max_inference_steps,
max_images_per_prompt, max_frames, max_pixels); the denoiser checks every request it takes
against them. `check_queued_generation` applies what the text encoder and the denoiser would
refuse (these caps, the checkpoint's size range from its config files) to a request's params
from the pipeline's spec alone, so a queue in front of the runtime (the jobs API) can refuse a
request when it is submitted instead of failing it when it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnistage.errors import InvalidRequestError
from omnistage.stages.diffusion.adapters.base import GenerationParams
from omnistage.stages.params import Param

CAPS_PARAMS = (
    Param("max_inference_steps", "integer", 1000, "Largest num_inference_steps a request may ask.", minimum=1),
    Param("max_images_per_prompt", "integer", 64, "Largest num_images_per_prompt.", minimum=1),
    Param("max_frames", "integer", 1024, "Largest num_frames.", minimum=1),
    Param("max_pixels", "integer", 4096 * 4096, "Largest width x height.", minimum=1),
)


@dataclass(frozen=True)
class RequestCaps:
    max_inference_steps: int
    max_images_per_prompt: int
    max_frames: int
    max_pixels: int

    @classmethod
    def from_stage_params(cls, params: Mapping[str, Any]) -> RequestCaps:
        """From a denoiser's (validated) stage params; a cap left out has its default."""
        return cls(**{p.name: params.get(p.name, p.default) for p in CAPS_PARAMS})

    def check(self, params: GenerationParams) -> None:
        """Raise InvalidRequestError naming the first setting above its cap."""
        for key, limit in (
            ("num_inference_steps", self.max_inference_steps),
            ("num_images_per_prompt", self.max_images_per_prompt),
            ("num_frames", self.max_frames),
        ):
            value = getattr(params, key)
            if value is not None and value > limit:
                raise InvalidRequestError(f"{key} must be <= {limit} on this server, got {value}", param=key)
        if params.width and params.height and params.width * params.height > self.max_pixels:
            raise InvalidRequestError(
                f"width x height must be <= {self.max_pixels} pixels on this server, got "
                f"{params.width}x{params.height}",
                param="width",
            )


def check_queued_generation(stage: Any, values: Mapping[str, Any]) -> None:
    """Refuse what a text_encoder or denoiser stage (a StageSpec) would refuse of a request's
    params `values`: the declared params, the checkpoint's size range when its config files
    are on disk, and for the denoiser its RequestCaps. InvalidRequestError naming the param."""
    from omnistage.stages.diffusion.limits import stage_model_limits

    params = GenerationParams.from_dict(dict(values))
    limits = stage_model_limits(stage)
    if limits is not None:
        limits.check(params)
    if stage.kind == "denoiser":
        RequestCaps.from_stage_params(stage.params or {}).check(params)
