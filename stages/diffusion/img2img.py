"""Image-to-image and previews for denoisers that hold their family's VAE.

Image-to-image follows diffusers' img2img pipelines: the init image is resized and scaled to
[-1, 1] by diffusers' VaeImageProcessor, encoded by the VAE (a sample of its latent
distribution, drawn from the request's generator), scaled into the transformer's latent space,
and noised to the schedule's first kept timestep: `strength` keeps the last
`steps * strength` timesteps. The noise comes from the same generator right after the
encoding sample, so a seed gives the pixels diffusers gives.

Inpainting (masked edits): an init image given as RGBA pixels ([H, W, 4] uint8) carries its
mask in the alpha channel, OpenAI's convention: transparent (alpha below 128 after diffusers'
binarisation) = repaint, opaque = keep. As diffusers' SD3 inpaint pipeline does for checkpoints
whose transformer has no mask channels, after every scheduler step the latents outside the mask
are replaced by the init image's latents noised to the next timestep with the request's initial
noise (the clean latents after the last step); the mask is resized to the latent grid by
nearest neighbour.

Previews (`partial_images`): after chosen steps the denoiser decodes its current estimate of
the clean latents (flow matching: x - sigma * v) with the same VAE.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistage.errors import InvalidRequestError
from omnistage.stages.media_limits import image_problem

DEFAULT_STRENGTH = 0.6


def as_pil(image: Any):
    """A pipeline `image` input (uint8 [H, W, 3] or [1, H, W, 3] tensor or array, encoded
    bytes, or a PIL image) as an RGB PIL image."""
    return image_and_mask(image)[0]


def image_and_mask(image: Any):
    """(RGB PIL image, repaint mask as an "L" PIL image with 255 = repaint, or None). Only uint8
    pixel arrays with 4 channels carry a mask (their alpha); images and bytes are edited whole."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB"), None
    if isinstance(image, (bytes, bytearray)):
        try:
            img = Image.open(io.BytesIO(bytes(image)))
            img.load()
        except Exception as exc:  # noqa: BLE001 - Pillow raises several kinds
            raise InvalidRequestError(f"image: not a decodable image: {image_problem(exc)}", param="image") from None
        return img.convert("RGB"), None
    if isinstance(image, str):  # a path or a URL is the caller's to read
        raise InvalidRequestError(
            "image: expected a PIL image, encoded image bytes or uint8 pixels [H, W, 3], got a string "
            "(PIL.Image.open reads a file)",
            param="image",
        )
    array = image.cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 3 or array.shape[-1] not in (3, 4) or array.dtype != np.uint8:
        raise InvalidRequestError(
            f"image: expected uint8 pixels [H, W, 3] (or [H, W, 4]: alpha = mask), got {array.dtype} "
            f"{list(array.shape)}",
            param="image",
        )
    mask = Image.fromarray(255 - array[..., 3]) if array.shape[-1] == 4 else None
    return Image.fromarray(np.ascontiguousarray(array[..., :3])), mask


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


@dataclass
class InpaintMask:
    """What keeps an inpainted request's latents outside its mask (diffusers' SD3 inpaint
    pipeline for a transformer without mask channels)."""

    mask: torch.Tensor  # [n, 1, h, w] on the latent grid: 1 = repaint
    clean: torch.Tensor  # the init image's latents
    noise: torch.Tensor  # the request's initial noise

    def blend(self, state: Any) -> torch.Tensor:
        """Called after the scheduler's step: the init image's latents noised to the next
        timestep (clean after the last) outside the mask, the denoised latents inside."""
        known = self.clean
        if state.step_index < state.total_steps:
            next_t = state.timesteps[state.step_index : state.step_index + 1]
            known = state.scheduler.scale_noise(self.clean, next_t, self.noise)
        return (1 - self.mask) * known + self.mask * state.latents


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
) -> tuple[torch.Tensor, torch.Tensor, InpaintMask | None]:
    """(latents noised to the first kept timestep, the kept timesteps, the inpainting mask of
    an RGBA image or None); sets the scheduler's begin index. `scheduler` has its timesteps set
    for the full num_inference_steps."""
    from diffusers.image_processor import VaeImageProcessor

    steps = len(scheduler.timesteps)
    start = first_step(steps, strength) * scheduler.order
    timesteps = scheduler.timesteps[start:]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(start)
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    rgb, mask_image = image_and_mask(image)
    pixels = VaeImageProcessor(vae_scale_factor=factor).preprocess(rgb, height=size[0], width=size[1])
    device = next(vae.parameters()).device
    latents = vae.encode(pixels.to(device, dtype)).latent_dist.sample(generator)
    shift = vae.config.get("shift_factor") or 0.0
    latents = (latents - shift) * vae.config.scaling_factor
    latents = torch.cat([latents] * num_images) if num_images > 1 else latents
    noise = torch.randn(latents.shape, generator=generator, device="cpu", dtype=dtype).to(latents.device)
    noised = scheduler.scale_noise(latents, timesteps[:1].repeat(num_images), noise).to(dtype)
    if mask_image is None:
        return noised, timesteps, None
    masks = VaeImageProcessor(
        vae_scale_factor=factor, do_normalize=False, do_binarize=True, do_convert_grayscale=True
    ).preprocess(mask_image, height=size[0], width=size[1])
    masks = torch.nn.functional.interpolate(masks, size=tuple(latents.shape[-2:])).to(latents.device, dtype)
    return noised, timesteps, InpaintMask(masks.repeat(num_images, 1, 1, 1), latents, noise)


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
