"""FLUX.1 (FluxTransformer2DModel, CLIP-L pooled + T5, AutoencoderKL).

Follows diffusers' FluxPipeline: guidance is distilled into the model (a per-row guidance
embedding, no CFG forward); latents are packed into 2x2 patches; sigmas are
linspace(1, 1/steps) shifted by mu = calculate_shift(image tokens); timesteps reach the model
divided by 1000. Optional true CFG (`true_cfg_scale` > 1 with a `negative_prompt`) runs the
negative rows in the same forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from omnistage.stages.diffusion.adapters.base import (
    DenoiserAdapter,
    DenoiseState,
    EncodedPrompts,
    GenerationParams,
    TextEncoderAdapter,
)
from omnistage.stages.diffusion.adapters.sd3 import (
    KLVae,
    clip_encode,
    merge_warnings,
    repeat_rows,
    t5_encode,
    vae_config,
    vae_config_scale_factor,
    vae_scale_factor,
)
from omnistage.stages.diffusion.limits import GenerationDefaults, ModelLimits, SizeRange

DEFAULT_GUIDANCE = 3.5
DEFAULT_STEPS = 28
DEFAULT_MAX_SEQUENCE_LENGTH = 512
DEFAULT_SAMPLE_SIZE = 128


def model_limits(transformer: dict[str, Any], vae: dict[str, Any]) -> ModelLimits:
    """FluxTransformer2DModel's range: sizes on multiples of VAE factor x 2 (latents are packed
    2x2); its RoPE positions are computed per request, so the model sets no largest size (the
    denoiser's max_pixels does). Default size 128 x VAE factor, as FluxPipeline."""
    factor = vae_config_scale_factor(vae)
    sizes = SizeRange(factor * 2, factor * 2)
    side = DEFAULT_SAMPLE_SIZE * factor
    return ModelLimits("flux", GenerationDefaults(side, side, DEFAULT_STEPS, DEFAULT_GUIDANCE), sizes)


def true_cfg(params: GenerationParams) -> bool:
    return (params.true_cfg_scale or 1.0) > 1 and params.negative_prompt is not None


class FluxTextEncoder(TextEncoderAdapter):
    family = "flux"
    component_names = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2")

    def default_max_sequence_length(self) -> int:
        return DEFAULT_MAX_SEQUENCE_LENGTH

    def uses_negative_prompt(self, params: GenerationParams) -> bool:
        return true_cfg(params)

    @torch.no_grad()
    def encode(self, prompts: list[str], max_sequence_length: int) -> EncodedPrompts:
        c = self.components
        clip_out, w1 = clip_encode(c["tokenizer"], c["text_encoder"], prompts, self.device, hidden_state=False)
        t5, w2 = t5_encode(c["tokenizer_2"], c["text_encoder_2"], prompts, max_sequence_length, self.device)
        return EncodedPrompts(
            embeds=t5.to(self.dtype),
            pooled=clip_out.pooler_output.to(self.dtype),
            warnings=merge_warnings(w1, w2),
        )


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Packed [b, (h/2)(w/2), 4c] -> [b, c, h, w] (h, w in latent pixels)."""
    b, _, channels = latents.shape
    latents = latents.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, channels // 4, h, w)


def image_ids(h2: int, w2: int, device, dtype) -> torch.Tensor:
    ids = torch.zeros(h2, w2, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(h2)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w2)[None, :]
    return ids.reshape(h2 * w2, 3).to(device=device, dtype=dtype)


class FluxDenoiser(DenoiserAdapter):
    family = "flux"
    component_names = ("transformer", "scheduler")

    def __init__(self, components, device, dtype):
        super().__init__(components, device, dtype)
        cfg = self.transformer.config
        self.vae_scale_factor = vae_scale_factor(components)
        self.latent_channels = cfg.in_channels // 4
        self.guidance_embeds = bool(cfg.guidance_embeds)
        self.limits = model_limits(dict(cfg), vae_config(components))

    def prepare(self, request_id, params, text) -> DenoiseState:
        settings = self.limits.resolve(params)
        h, w = settings.height, settings.width
        steps = settings.num_inference_steps
        guidance = settings.guidance_scale
        do_cfg = true_cfg(params)
        if do_cfg and not text.has_negative:
            raise ValueError("true CFG needs the negative prompt row from the text encoder (give it the same params)")
        if text.pooled is None:
            raise ValueError("FLUX needs pooled_prompt_embeds")
        n = params.num_images_per_prompt
        lh = 2 * (h // (self.vae_scale_factor * 2))
        lw = 2 * (w // (self.vae_scale_factor * 2))
        generator = self.make_generator(params)
        latents = pack_latents(self.draw_latents((n, self.latent_channels, lh, lw), generator))
        seq = latents.shape[1]
        sconf = self.scheduler_template.config
        sigmas = None if sconf.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / steps, steps)
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        mu = calculate_shift(
            seq,
            sconf.get("base_image_seq_len", 256),
            sconf.get("max_image_seq_len", 4096),
            sconf.get("base_shift", 0.5),
            sconf.get("max_shift", 1.15),
        )
        scheduler = self.new_scheduler(steps, sigmas=sigmas, mu=mu)
        embeds = text.embeds.to(self.device, self.dtype)
        pooled = text.pooled.to(self.device, self.dtype)
        rows_ehs = repeat_rows(embeds[0:1], n)
        rows_pooled = repeat_rows(pooled[0:1], n)
        if do_cfg:
            rows_ehs = torch.cat([repeat_rows(embeds[1:2], n), rows_ehs])
            rows_pooled = torch.cat([repeat_rows(pooled[1:2], n), rows_pooled])
        rows = n * (2 if do_cfg else 1)
        row_inputs: dict[str, Any] = {"encoder_hidden_states": rows_ehs, "pooled_projections": rows_pooled}
        if self.guidance_embeds:
            row_inputs["guidance"] = torch.full((rows,), guidance, device=self.device, dtype=torch.float32)
        return DenoiseState(
            request_id=request_id,
            params=params,
            latents=latents,
            scheduler=scheduler,
            timesteps=scheduler.timesteps,
            generator=generator,
            bucket=("flux", tuple(latents.shape[1:]), tuple(rows_ehs.shape[1:]), tuple(rows_pooled.shape[1:])),
            rows=rows,
            tokens_per_row=seq,
            row_inputs=row_inputs,
            shared={
                "img_ids": image_ids(lh // 2, lw // 2, self.device, self.dtype),
                "txt_ids": torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype),
            },
            guidance=float(params.true_cfg_scale or 1.0),
            do_cfg=do_cfg,
            extra={"latent_hw": (lh, lw)},
        )

    def model_forward(self, states: list[DenoiseState]) -> torch.Tensor:
        hidden = torch.cat([torch.cat([s.latents] * 2) if s.do_cfg else s.latents for s in states])
        timestep = torch.cat([s.timestep.expand(s.rows).to(s.latents.dtype) for s in states]) / 1000
        rows = self.batched_rows(states)
        first = states[0]
        return self.transformer(
            hidden_states=hidden,
            timestep=timestep,
            guidance=rows.get("guidance"),
            pooled_projections=rows["pooled_projections"],
            encoder_hidden_states=rows["encoder_hidden_states"],
            txt_ids=first.shared["txt_ids"],
            img_ids=first.shared["img_ids"],
            return_dict=False,
        )[0]

    def finish(self, state: DenoiseState) -> torch.Tensor:
        lh, lw = state.extra["latent_hw"]
        return unpack_latents(state.latents, lh, lw)


class FluxVae(KLVae):
    family = "flux"


TEXT_ENCODER = FluxTextEncoder
DENOISER = FluxDenoiser
VAE = FluxVae
