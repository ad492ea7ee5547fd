"""What a diffusion checkpoint accepts: default generation settings and the valid size range.

Each family module (adapters/sd3.py, flux.py, wan.py) derives a `ModelLimits` from the
checkpoint's config files (`model_limits(transformer_config, vae_config)`): the size
multiple (VAE factor x patch size), the largest size its positional embedding covers
(SD3's `pos_embed_max_size`, Wan's `rope_max_seq_len`), the frame counts its VAE can encode
(Wan: 4k+1) and the defaults a request gets for what it leaves out (the family's, as its
diffusers pipeline has them, fitted into the checkpoint's range). A pipeline YAML may restate
the defaults in a stage's `defaults:` param; they are checked against the range at start-up.

The text encoder stage checks a request against these limits before any denoising is
queued (it reads the config files only, no weights), and the denoiser checks again (for
graphs where it is the first stage), so a size the model cannot take is a 400 naming the
parameter instead of a shape error inside a transformer forward.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.errors import InvalidRequestError

# keys a pipeline may restate under a stage's `defaults:` param
DEFAULT_KEYS = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale")


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request gets for the settings it leaves out."""

    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    num_frames: int | None = None  # video families only


@dataclass(frozen=True)
class SizeRange:
    """Sizes and frame counts one checkpoint accepts (None: no model bound)."""

    height_multiple: int
    width_multiple: int
    max_height: int | None = None
    max_width: int | None = None
    frame_step: int | None = None  # video: num_frames = k * frame_step + 1
    max_frames: int | None = None

    def check(self, height: int | None, width: int | None, num_frames: int | None) -> None:
        """Raise InvalidRequestError naming the first parameter outside the range."""
        for name, value, multiple, top in (
            ("height", height, self.height_multiple, self.max_height),
            ("width", width, self.width_multiple, self.max_width),
        ):
            if value is None:
                continue
            if top is not None and value > top:
                raise InvalidRequestError(
                    f"{name} must be <= {top} for this model (its positional embedding covers "
                    f"{top} pixels), got {value}",
                    param=name,
                )
            if value % multiple:
                lower = max(multiple, value - value % multiple)
                raise InvalidRequestError(
                    f"{name} must be a multiple of {multiple} for this model (VAE factor x patch size), "
                    f"got {value}; e.g. {lower}",
                    param=name,
                )
        if num_frames is None:
            return
        if self.frame_step is None:
            if num_frames != 1:
                raise InvalidRequestError(
                    f"num_frames: this model makes images (num_frames 1), got {num_frames}", param="num_frames"
                )
            return
        if (num_frames - 1) % self.frame_step:
            raise InvalidRequestError(
                f"num_frames must be {self.frame_step}k+1 for this model (e.g. "
                f"{num_frames - (num_frames - 1) % self.frame_step}), got {num_frames}",
                param="num_frames",
            )
        if self.max_frames is not None and num_frames > self.max_frames:
            raise InvalidRequestError(
                f"num_frames must be <= {self.max_frames} for this model (its positional embedding "
                f"covers {self.max_frames} frames), got {num_frames}",
                param="num_frames",
            )

    def fit(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) scaled down (aspect kept) into the range, on the size multiples."""
        scale = 1.0
        if self.max_height is not None and height > self.max_height:
            scale = min(scale, self.max_height / height)
        if self.max_width is not None and width > self.max_width:
            scale = min(scale, self.max_width / width)
        h = max(self.height_multiple, int(height * scale) // self.height_multiple * self.height_multiple)
        w = max(self.width_multiple, int(width * scale) // self.width_multiple * self.width_multiple)
        return h, w

    def fit_frames(self, num_frames: int) -> int:
        if self.max_frames is not None and num_frames > self.max_frames:
            return self.max_frames
        return num_frames


@dataclass(frozen=True)
class ModelLimits:
    """One checkpoint's defaults and valid range (see the module docstring)."""

    family: str
    defaults: GenerationDefaults
    sizes: SizeRange

    def check(self, params: Any) -> None:
        """Check the sizes a request gives (a GenerationParams); raise InvalidRequestError."""
        self.sizes.check(params.height, params.width, params.num_frames)

    def resolve(self, params: Any) -> GenerationDefaults:
        """The request's settings with defaults filled in, checked against the range."""
        self.check(params)
        d = self.defaults
        return GenerationDefaults(
            height=params.height or d.height,
            width=params.width or d.width,
            num_frames=params.num_frames or d.num_frames,
            num_inference_steps=params.num_inference_steps or d.num_inference_steps,
            guidance_scale=d.guidance_scale if params.guidance_scale is None else float(params.guidance_scale),
        )

    def with_defaults(self, overrides: dict[str, Any] | None) -> ModelLimits:
        """These limits with a pipeline's restated defaults; ValueError when one is outside
        the model's range or not a known key (a start-up error, not a request error)."""
        if not overrides:
            return self
        unknown = set(overrides) - set(DEFAULT_KEYS)
        if unknown:
            raise ValueError(f"defaults: unknown key(s) {sorted(unknown)}; known: {', '.join(DEFAULT_KEYS)}")
        merged = dataclasses.replace(self.defaults, **overrides)
        try:
            self.sizes.check(merged.height, merged.width, merged.num_frames)
        except InvalidRequestError as exc:
            raise ValueError(f"defaults.{exc.param}: {exc}") from None
        return dataclasses.replace(self, defaults=merged)

    def describe(self) -> dict[str, Any]:
        """Plain data for listings and logs."""
        return {"family": self.family, **dataclasses.asdict(self.defaults), **dataclasses.asdict(self.sizes)}


def defaults_problem(value: Any) -> str | None:
    """YAML validation of a denoiser's `defaults:` param (keys and types; the range is the
    model's, checked when the stage starts)."""
    problems = []
    for key, v in dict(value or {}).items():
        if key not in DEFAULT_KEYS:
            problems.append(f"unknown key {key!r} (known: {', '.join(DEFAULT_KEYS)})")
        elif key == "guidance_scale":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                problems.append(f"guidance_scale must be a number >= 0, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.append(f"{key} must be a positive integer, got {v!r}")
    return "; ".join(problems) or None


def read_config(folder: Path | None) -> dict[str, Any] | None:
    """A component folder's config.json as a dict, or None when there is none."""
    if folder is None:
        return None
    path = Path(folder) / "config.json"
    return json.loads(path.read_text()) if path.exists() else None


def checkpoint_limits(ctx: Any) -> ModelLimits | None:
    """The limits of the checkpoint a diffusion stage context points at, from its transformer
    and VAE config files (no weights are read), with the stage's `defaults:` applied. None
    when the transformer's config cannot be found (a text encoder given on its own)."""
    from omnistage.stages.diffusion.adapters import family_module
    from omnistage.stages.diffusion.loading import detect_family, stage_root

    params = dict(ctx.params or {})
    root = stage_root(ctx.model_path)
    overrides = dict(params.get("components") or {})
    if ctx.kind == "denoiser" and root is None and ctx.model_path is not None:
        overrides.setdefault("transformer", str(ctx.model_path))

    def folder(name: str) -> Path | None:
        if name in overrides:
            return Path(overrides[name]).expanduser()
        return Path(root) / name if root is not None else None

    transformer_config = read_config(folder("transformer"))
    if transformer_config is None:
        return None
    try:
        family = detect_family(root, {**params, "components": overrides})
    except ValueError:
        return None
    limits = family_module(family).model_limits(transformer_config, read_config(folder("vae")) or {})
    return limits.with_defaults(params.get("defaults"))


def stage_limits(stage: Any) -> dict[str, Any] | None:
    """A denoiser stage's defaults (its `defaults` param applied) and range as plain data,
    for listings (GET /v1/pipelines/NAME); None for other kinds. See stage_model_limits."""
    if stage.kind != "denoiser":
        return None
    limits = stage_model_limits(stage)
    return limits.describe() if limits is not None else None


def stage_model_limits(stage: Any) -> ModelLimits | None:
    """The limits of a text_encoder or denoiser stage (a StageSpec) whose model is already on
    disk (call it once the pipeline is ready: a tiny recipe is then built and this only reads
    two config files; cached). None for other kinds or when the checkpoint cannot be read."""
    if stage.kind not in ("text_encoder", "denoiser") or stage.model is None:
        return None
    key = (stage.kind, stage.model.source, stage.model.subfolder, json.dumps(stage.params, sort_keys=True, default=str))
    if key not in _STAGE_LIMITS:
        from types import SimpleNamespace

        from omnistage.models.recipes import resolve_model

        try:
            path = resolve_model(stage.model.source, stage.model.subfolder)
            ctx = SimpleNamespace(kind=stage.kind, model_path=str(path), params=dict(stage.params or {}))
            _STAGE_LIMITS[key] = checkpoint_limits(ctx)
        except (OSError, ValueError, KeyError, InvalidRequestError):  # e.g. a hub id not in the local cache
            _STAGE_LIMITS[key] = None
    return _STAGE_LIMITS[key]


_STAGE_LIMITS: dict[tuple, ModelLimits | None] = {}


def denoiser_limits(spec: Any) -> ModelLimits | None:
    """stage_model_limits of a pipeline's (first) denoiser stage; None without one."""
    denoiser = next((stage for stage in spec.stages.values() if stage.kind == "denoiser"), None)
    return stage_model_limits(denoiser) if denoiser is not None else None
