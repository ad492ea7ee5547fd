"""Tiled and sliced VAE decoding for outputs too large to decode in one call.

`decode_latents(vae, z, options)` is the one entry point a VAE stage calls with scaled-back
latents [n, C, h, w]: it returns the decoder's raw sample [n, 3, H, W] (in [-1, 1] before the
caller's postprocessing), decoding

- sliced: one sample of the batch at a time (`slicing: true`) - peak memory of one image;
- tiled: overlapping latent tiles, each decoded alone, blended linearly across the overlap
  (`tiling: true`, or automatically when the output has more than `auto_tile_pixels` pixels).

Tiling reproduces diffusers' AutoencoderKL.tiled_decode (same tiles, same blend, same crop:
equal to `vae.enable_tiling()` with tile_latent_min_size = `tile_latent_size`,
tile_sample_min_size = `tile_latent_size` x the VAE's scale factor, tile_overlap_factor =
`tile_overlap`), but keeps only one row of decoded tiles alive at a time and vectorizes
the blend ramps instead of looping per pixel row.

Wan's 3-D VAE has its own spatial tiling; its adapter enables that (see adapters/wan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TilingOptions:
    tiling: bool = False
    tile_latent_size: int | None = None  # None: the VAE's own tile_latent_min_size
    tile_overlap: float = 0.25
    slicing: bool = False
    auto_tile_pixels: int | None = None  # tile when H*W of the output exceeds this

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> TilingOptions:
        params = params or {}
        opts = cls(
            tiling=bool(params.get("tiling", False)),
            tile_latent_size=params.get("tile_latent_size"),
            tile_overlap=float(params.get("tile_overlap", 0.25)),
            slicing=bool(params.get("slicing", False)),
            auto_tile_pixels=params.get("auto_tile_pixels"),
        )
        if not 0.0 <= opts.tile_overlap < 1.0:
            raise ValueError(f"tile_overlap must be in [0, 1), got {opts.tile_overlap}")
        if opts.tile_latent_size is not None and int(opts.tile_latent_size) < 2:
            raise ValueError(f"tile_latent_size must be >= 2, got {opts.tile_latent_size}")
        return opts


def vae_scale_factor(vae) -> int:
    return 2 ** (len(vae.config.block_out_channels) - 1)


def _latent_tile(vae, opts: TilingOptions) -> int:
    if opts.tile_latent_size is not None:
        return int(opts.tile_latent_size)
    return int(getattr(vae, "tile_latent_min_size", 64))


def wants_tiling(vae, z: torch.Tensor, opts: TilingOptions) -> bool:
    tile = _latent_tile(vae, opts)
    bigger_than_tile = z.shape[-1] > tile or z.shape[-2] > tile
    if opts.tiling:
        return bigger_than_tile
    if opts.auto_tile_pixels is not None:
        scale = vae_scale_factor(vae)
        return bigger_than_tile and z.shape[-1] * z.shape[-2] * scale * scale > opts.auto_tile_pixels
    return False


@torch.no_grad()
def decode_latents(vae, z: torch.Tensor, options: TilingOptions | dict[str, Any] | None = None) -> torch.Tensor:
    """Decode [n, C, h, w] latents (already un-scaled) with an AutoencoderKL-style VAE."""
    opts = options if isinstance(options, TilingOptions) else TilingOptions.from_params(options)
    if opts.slicing and z.shape[0] > 1:
        return torch.cat([decode_latents(vae, part, _no_slicing(opts)) for part in z.split(1)])
    if wants_tiling(vae, z, opts):
        return tiled_decode(vae, z, _latent_tile(vae, opts), opts.tile_overlap)
    if getattr(vae, "post_quant_conv", None) is not None:
        z = vae.post_quant_conv(z)
    return vae.decoder(z)


def _no_slicing(opts: TilingOptions) -> TilingOptions:
    return TilingOptions(opts.tiling, opts.tile_latent_size, opts.tile_overlap, False, opts.auto_tile_pixels)


def _ramps(extent: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # (1 - y/E) and y/E computed in double, then rounded once: the same factors diffusers'
    # per-row Python-float products use.
    y = torch.arange(extent, dtype=torch.float64) / extent
    return (1 - y).to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def _blend_rows(above: torch.Tensor, tile: torch.Tensor, extent: int) -> None:
    """In place: the first `extent` rows of tile fade in from the last rows of `above`."""
    extent = min(above.shape[2], tile.shape[2], extent)
    if extent <= 0:
        return
    keep, take = _ramps(extent, tile.dtype, tile.device)
    a = above[:, :, above.shape[2] - extent :, :]
    tile[:, :, :extent, :] = a * keep.view(1, 1, -1, 1) + tile[:, :, :extent, :] * take.view(1, 1, -1, 1)


def _blend_cols(left: torch.Tensor, tile: torch.Tensor, extent: int) -> None:
    extent = min(left.shape[3], tile.shape[3], extent)
    if extent <= 0:
        return
    keep, take = _ramps(extent, tile.dtype, tile.device)
    a = left[:, :, :, left.shape[3] - extent :]
    tile[:, :, :, :extent] = a * keep.view(1, 1, 1, -1) + tile[:, :, :, :extent] * take.view(1, 1, 1, -1)


@torch.no_grad()
def tiled_decode(vae, z: torch.Tensor, tile_latent: int, overlap: float = 0.25) -> torch.Tensor:
    """diffusers' tiled decode with only the previous row of decoded tiles kept alive."""
    scale = vae_scale_factor(vae)
    tile_sample = tile_latent * scale
    stride = int(tile_latent * (1 - overlap))
    extent = int(tile_sample * overlap)
    keep = tile_sample - extent  # each tile contributes its top-left keep x keep pixels
    if stride < 1:
        raise ValueError(f"tile of {tile_latent} latents with overlap {overlap} has no stride")
    use_pqc = (
        bool(getattr(vae.config, "use_post_quant_conv", True)) and getattr(vae, "post_quant_conv", None) is not None
    )
    strips: list[torch.Tensor] = []
    previous: list[torch.Tensor] | None = None
    for i in range(0, z.shape[2], stride):
        row: list[torch.Tensor] = []
        for j in range(0, z.shape[3], stride):
            tile = z[:, :, i : i + tile_latent, j : j + tile_latent]
            if use_pqc:
                tile = vae.post_quant_conv(tile)
            decoded = vae.decoder(tile)
            if previous is not None:
                _blend_rows(previous[len(row)], decoded, extent)
            if row:
                _blend_cols(row[-1], decoded, extent)
            row.append(decoded)
        strips.append(torch.cat([t[:, :, :keep, :keep] for t in row], dim=3))
        previous = row
    return torch.cat(strips, dim=2)
