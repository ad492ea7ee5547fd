"""Stable Diffusion 3 (SD3Transformer2DModel, CLIP-L + CLIP-G + T5, AutoencoderKL).

Follows diffusers' StableDiffusion3Pipeline: prompt embeddings are the two CLIP penultimate
hidden states (concatenated, zero-padded to T5's width) followed by T5's; pooled embeddings
are the two CLIP projections; CFG runs [negative x n, prompt x n] in one forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from omnistage.errors import InvalidRequestError
from omnistage.stages.diffusion.adapters.base import (
    DenoiserAdapter,
    DenoiseState,
    EncodedPrompts,
    GenerationParams,
    TextConditioning,
    TextEncoderAdapter,
    VaeAdapter,
)
from omnistage.stages.diffusion.img2img import (
    DEFAULT_STRENGTH,
    decode_pixels,
    flow_estimate,
    noised_image_latents,
    preview_steps,
)
from omnistage.stages.diffusion.limits import GenerationDefaults, ModelLimits, SizeRange

DEFAULT_GUIDANCE = 7.0
DEFAULT_STEPS = 28
DEFAULT_MAX_SEQUENCE_LENGTH = 256


def vae_config(components: dict[str, Any]) -> dict[str, Any]:
    """The VAE's config: the loaded VAE's, else its config.json as build_adapter read it."""
    vae = components.get("vae")
    return dict(vae.config) if vae is not None else dict(components.get("vae_config") or {})


def vae_scale_factor(components: dict[str, Any]) -> int:
    return vae_config_scale_factor(vae_config(components))


def vae_config_scale_factor(cfg: Any) -> int:
    """AutoencoderKL's spatial factor, as diffusers' pipelines compute it (8 without a config)."""
    blocks = cfg.get("block_out_channels") if hasattr(cfg, "get") else getattr(cfg, "block_out_channels", None)
    return 2 ** (len(blocks) - 1) if blocks else 8


def model_limits(transformer: dict[str, Any], vae: dict[str, Any]) -> ModelLimits:
    """SD3Transformer2DModel's range: sizes on multiples of VAE factor x patch size, at most
    pos_embed_max_size patches a side; default size sample_size x VAE factor (diffusers'
    StableDiffusion3Pipeline default), fitted into the range."""
    factor = vae_config_scale_factor(vae)
    patch = int(transformer.get("patch_size") or 2)
    pos = transformer.get("pos_embed_max_size")
    top = int(pos) * patch * factor if pos else None
    sizes = SizeRange(factor * patch, factor * patch, top, top)
    side = int(transformer.get("sample_size") or 128) * factor
    height, width = sizes.fit(side, side)
    return ModelLimits("sd3", GenerationDefaults(height, width, DEFAULT_STEPS, DEFAULT_GUIDANCE), sizes)


def truncation_warnings(tokenizer, prompts: list[str], max_length: int, what: str) -> list[list[str]]:
    """Per prompt, diffusers' truncation notice when tokenizing cut the prompt short."""
    out: list[list[str]] = []
    for prompt in prompts:
        full = tokenizer(prompt).input_ids
        if len(full) > max_length:
            removed = tokenizer.decode(full[max_length - 1 : -1])
            out.append([f"prompt truncated to {max_length} tokens for {what}; removed: {removed!r}"])
        else:
            out.append([])
    return out


def merge_warnings(*per_encoder: list[list[str]]) -> list[list[str]]:
    merged = [[] for _ in per_encoder[0]]
    for lists in per_encoder:
        for i, w in enumerate(lists):
            merged[i].extend(w)
    return merged


def clip_encode(tokenizer, encoder, prompts: list[str], device, hidden_state: bool):
    max_length = tokenizer.model_max_length
    ids = tokenizer(
        prompts, padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    ).input_ids
    warnings = truncation_warnings(tokenizer, prompts, max_length, type(encoder).__name__)
    out = encoder(ids.to(device), output_hidden_states=hidden_state)
    return out, warnings


def t5_encode(tokenizer, encoder, prompts: list[str], max_sequence_length: int, device):
    ids = tokenizer(
        prompts,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    ).input_ids
    warnings = truncation_warnings(tokenizer, prompts, max_sequence_length, "T5 (max_sequence_length)")
    return encoder(ids.to(device))[0], warnings


class SD3TextEncoder(TextEncoderAdapter):
    family = "sd3"
    component_names = ("tokenizer", "tokenizer_2", "tokenizer_3", "text_encoder", "text_encoder_2", "text_encoder_3")

    def default_max_sequence_length(self) -> int:
        return DEFAULT_MAX_SEQUENCE_LENGTH

    def uses_negative_prompt(self, params: GenerationParams) -> bool:
        g = DEFAULT_GUIDANCE if params.guidance_scale is None else params.guidance_scale
        return g > 1

    @torch.no_grad()
    def encode(self, prompts: list[str], max_sequence_length: int) -> EncodedPrompts:
        c = self.components
        if c.get("text_encoder_3") is None:
            raise RuntimeError("SD3 without its T5 text encoder is not supported")
        hidden, pooled, warns = [], [], []
        for tok, enc in (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")):
            out, w = clip_encode(c[tok], c[enc], prompts, self.device, hidden_state=True)
            hidden.append(out.hidden_states[-2].to(self.dtype))
            pooled.append(out[0].to(self.dtype))
            warns.append(w)
        t5, w = t5_encode(c["tokenizer_3"], c["text_encoder_3"], prompts, max_sequence_length, self.device)
        t5 = t5.to(self.dtype)
        warns.append(w)
        clip = torch.cat(hidden, dim=-1)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return EncodedPrompts(
            embeds=torch.cat([clip, t5], dim=-2),
            pooled=torch.cat(pooled, dim=-1),
            warnings=merge_warnings(*warns),
        )


def repeat_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.repeat_interleave(n, dim=0) if n > 1 else t


class SD3Denoiser(DenoiserAdapter):
    family = "sd3"
    # the VAE encodes img2img init images and decodes previews (absent: both refused)
    component_names = ("transformer", "scheduler", "vae")
    optional_components = ("vae",)
    image_input = True
    previews = True

    def __init__(self, components, device, dtype):
        super().__init__(components, device, dtype)
        cfg = self.transformer.config
        self.vae_scale_factor = vae_scale_factor(components)
        self.patch_size = cfg.patch_size
        self.in_channels = cfg.in_channels
        self.limits = model_limits(dict(cfg), vae_config(components))

    def cfg_rows(self, text: TextConditioning, n: int, do_cfg: bool, key: str) -> torch.Tensor | None:
        t = getattr(text, key)
        if t is None:
            return None
        t = t.to(self.device, self.dtype)
        cond = repeat_rows(t[0:1], n)
        if not do_cfg:
            return cond
        return torch.cat([repeat_rows(t[1:2], n), cond])

    def prepare(self, request_id, params, text, image=None) -> DenoiseState:
        settings = self.limits.resolve(params)
        h, w = settings.height, settings.width
        steps = settings.num_inference_steps
        guidance = settings.guidance_scale
        do_cfg = guidance > 1
        if do_cfg and not text.has_negative:
            raise ValueError("CFG needs the negative prompt row from the text encoder (give it the same params)")
        if text.pooled is None:
            raise ValueError("SD3 needs pooled_prompt_embeds")
        n = params.num_images_per_prompt
        generator = self.make_generator(params)
        lh, lw = h // self.vae_scale_factor, w // self.vae_scale_factor
        kwargs: dict[str, Any] = {}
        sconf = self.scheduler_template.config
        if sconf.get("use_dynamic_shifting", False):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            seq = (lh // self.patch_size) * (lw // self.patch_size)
            kwargs["mu"] = calculate_shift(
                seq,
                sconf.get("base_image_seq_len", 256),
                sconf.get("max_image_seq_len", 4096),
                sconf.get("base_shift", 0.5),
                sconf.get("max_shift", 1.16),
            )
        scheduler = self.new_scheduler(steps, **kwargs)
        inpaint = None
        if image is None:
            latents, timesteps = self.draw_latents((n, self.in_channels, lh, lw), generator), scheduler.timesteps
        else:
            strength = DEFAULT_STRENGTH if params.strength is None else params.strength
            vae = self.require_vae("image")
            latents, timesteps, inpaint = noised_image_latents(
                vae, scheduler, image, (h, w), strength, n, generator, self.dtype
            )
        ehs = self.cfg_rows(text, n, do_cfg, "embeds")
        pooled = self.cfg_rows(text, n, do_cfg, "pooled")
        return DenoiseState(
            request_id=request_id,
            params=params,
            latents=latents,
            scheduler=scheduler,
            timesteps=timesteps,
            generator=generator,
            bucket=("sd3", tuple(latents.shape[1:]), tuple(ehs.shape[1:]), tuple(pooled.shape[1:])),
            rows=n * (2 if do_cfg else 1),
            tokens_per_row=(lh // self.patch_size) * (lw // self.patch_size),
            row_inputs={"encoder_hidden_states": ehs, "pooled_projections": pooled},
            guidance=guidance,
            do_cfg=do_cfg,
            extra={
                "height": h,
                "width": w,
                "preview_steps": self.preview_plan(params, len(timesteps)),
                "inpaint": inpaint,
            },
        )

    def require_vae(self, param: str):
        vae = self.components.get("vae")
        if vae is None:
            raise InvalidRequestError(f"{param}: this denoiser was loaded without its VAE", param=param)
        return vae

    def preview_plan(self, params, total_steps: int) -> frozenset[int]:
        if not params.partial_images:
            return frozenset()
        self.require_vae("partial_images")
        return preview_steps(total_steps, params.partial_images)

    def step(self, state: DenoiseState, model_output: torch.Tensor) -> None:
        super().step(state, model_output)
        if (inpaint := state.extra.get("inpaint")) is not None:
            state.latents = inpaint.blend(state)

    def estimate(self, state: DenoiseState, model_output: torch.Tensor) -> torch.Tensor:
        return flow_estimate(state, model_output)

    def decode_preview(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_pixels(self.components["vae"], latents)

    def model_forward(self, states: list[DenoiseState]) -> torch.Tensor:
        hidden = torch.cat([torch.cat([s.latents] * 2) if s.do_cfg else s.latents for s in states])
        timestep = torch.cat([s.timestep.expand(s.rows) for s in states])
        rows = self.batched_rows(states)
        return self.transformer(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=rows["encoder_hidden_states"],
            pooled_projections=rows["pooled_projections"],
            return_dict=False,
        )[0]

    def finish(self, state: DenoiseState) -> torch.Tensor:
        return state.latents


class KLVae(VaeAdapter):
    """AutoencoderKL decode as diffusers' SD3/FLUX pipelines do it. Stage params `tiling`,
    `slicing`, `auto_tile_pixels`, `tile_latent_size`, `tile_overlap` (vae_tiling.py) decode
    large outputs in tiles / one sample at a time."""

    family = "sd3"

    def __init__(self, components, device, dtype, options):
        super().__init__(components, device, dtype, options)
        from omnistage.stages.diffusion.vae_tiling import TilingOptions

        self.tiling = TilingOptions.from_params(options)

    @torch.no_grad()
    def decode_batch(self, latents: torch.Tensor) -> torch.Tensor:
        from omnistage.stages.diffusion.vae_tiling import decode_latents

        cfg = self.vae.config
        z = latents.to(self.device, self.vae.dtype) / cfg.scaling_factor
        if cfg.get("shift_factor") is not None:
            z = z + cfg.shift_factor
        image = decode_latents(self.vae, z, self.tiling)
        return (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)


TEXT_ENCODER = SD3TextEncoder
DENOISER = SD3Denoiser
VAE = KLVae
