"""Image-to-image and previews for denoisers that hold their family's VAE.

Image-to-image follows diffusers' img2img pipelines: the init image is resized and scaled to
[-1, 1] by diffusers' VaeImageProcessor, encoded by the VAE (a sample of its latent
distribution, drawn from the request's generator), scaled into the transformer's latent space,
and noised to the schedule's first kept timestep: `strength` keeps the last
`steps * strength` timesteps. The noise comes from the same generator right after the
encoding sample, so a seed gives the pixels diffusers gives.

Previews (`partial_images`): after chosen steps the denoiser decodes its current estimate of
the clean latents (flow matching: x - sigma * v) with the same VAE.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from omnistage.errors import InvalidRequestError

DEFAULT_STRENGTH = 0.6


def as_pil(image: Any):
    """A pipeline `image` input (uint8 [H, W, 3] or [1, H, W, 3] tensor or array, encoded
    bytes, or a PIL image) as an RGB PIL image."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (bytes, bytearray)):
        try:
            img = Image.open(io.BytesIO(bytes(image)))
            img.load()
        except Exception as exc:  # noqa: BLE001 - Pillow raises several kinds
            raise InvalidRequestError(f"image: not a decodable image ({exc})", param="image") from None
        return img.convert("RGB")
    array = image.cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
        raise InvalidRequestError(
            f"image: expected uint8 pixels [H, W, 3], got {array.dtype} {list(array.shape)}", param="image"
        )
    return Image.fromarray(array)


def first_step(num_inference_steps: int, strength: float) -> int:
    """Index of the first timestep img2img keeps (diffusers' get_timesteps)."""
    kept = min(num_inference_steps * strength, num_inference_steps)
    start = int(max(num_inference_steps - kept, 0))
    if num_inference_steps - start < 1:
        raise InvalidRequestError(
            f"strength {strength} with num_inference_steps {num_inference_steps} leaves no denoising step; "
            "raise either",
            param="strength",
        )
    return start


@torch.no_grad()
def noised_image_latents(
    vae: Any,
    scheduler: Any,
    image: Any,
    size: tuple[int, int],
    strength: float,
    num_images: int,
    generator: torch.Generator,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents noised to the first kept timestep, the kept timesteps); sets the scheduler's
    begin index. `scheduler` has its timesteps set for the full num_inference_steps."""
    from diffusers.image_processor import VaeImageProcessor

    steps = len(scheduler.timesteps)
    start = first_step(steps, strength) * scheduler.order
    timesteps = scheduler.timesteps[start:]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(start)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    pixels = VaeImageProcessor(vae_scale_factor=factor).preprocess(as_pil(image), height=size[0], width=size[1])
    device = next(vae.parameters()).device
    latents = vae.encode(pixels.to(device, dtype)).latent_dist.sample(generator)
    shift = vae.config.get("shift_factor") or 0.0
    latents = (latents - shift) * vae.config.scaling_factor
    latents = torch.cat([latents] * num_images) if num_images > 1 else latents
    noise = torch.randn(latents.shape, generator=generator, device="cpu", dtype=dtype).to(latents.device)
    return scheduler.scale_noise(latents, timesteps[:1].repeat(num_images), noise).to(dtype), timesteps


def preview_steps(total_steps: int, partial_images: int) -> frozenset[int]:
    """The steps (0-based) after which a preview is decoded: evenly spaced, never the last."""
    picks = {(i * total_steps) // (partial_images + 1) - 1 for i in range(1, partial_images + 1)}
    return frozenset(s for s in picks if 0 <= s < total_steps - 1)


def flow_estimate(state: Any, model_output: torch.Tensor) -> torch.Tensor:
    """Flow matching's estimate of the clean latents before this step: x - sigma * v."""
    sched = state.scheduler
    index = (getattr(sched, "begin_index", None) or 0) + state.step_index
    sigma = sched.sigmas[index].to(state.latents.device, state.latents.dtype)
    return state.latents - sigma * model_output


@torch.no_grad()
def decode_pixels(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Latents in the transformer's space -> uint8 pixels [n, H, W, 3], as the VAE stage decodes."""
    cfg = vae.config
    z = latents.to(vae.dtype) / cfg.scaling_factor + (cfg.get("shift_factor") or 0.0)
    image = vae.decode(z, return_dict=False)[0]
    pixels = (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)
    return (pixels.float() * 255).round().clamp(0, 255).to(torch.uint8).cpu().contiguous()
