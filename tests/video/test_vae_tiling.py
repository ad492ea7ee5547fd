"""Tiled / sliced VAE decode against diffusers' AutoencoderKL with tiling enabled."""

from __future__ import annotations

import pytest
import torch

from omnistage.stages.diffusion.vae_tiling import TilingOptions, decode_latents, wants_tiling


@pytest.fixture(scope="module")
def small_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
    ).eval()


@pytest.mark.parametrize("shape", [(2, 4, 20, 28), (1, 4, 8, 13)])
def test_tiled_decode_equals_diffusers_tiling(small_vae, shape):
    z = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = small_vae.decode(z).sample
        small_vae.enable_tiling()
        small_vae.tile_latent_min_size, small_vae.tile_sample_min_size = 8, 32  # scale factor 4
        try:
            reference = small_vae.decode(z).sample
        finally:
            small_vae.disable_tiling()
    opts = {"tiling": True, "tile_latent_size": 8}
    assert wants_tiling(small_vae, z, TilingOptions.from_params(opts))
    assert (plain - reference).abs().max() > 1e-2  # tiling really happened (seams differ)
    mine = decode_latents(small_vae, z, opts)
    assert mine.shape == reference.shape
    assert (mine - reference).abs().max().item() < 1e-5
    sliced = decode_latents(small_vae, z, dict(opts, slicing=True))
    assert (sliced - reference).abs().max().item() < 1e-4


def test_untiled_and_auto_threshold(small_vae):
    z = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = small_vae.decode(z).sample
    assert torch.equal(decode_latents(small_vae, z, None), plain)
    assert (decode_latents(small_vae, z, {"slicing": True}) - plain).abs().max().item() < 1e-4
    big = torch.randn(1, 4, 20, 20)
    assert wants_tiling(small_vae, big, TilingOptions(auto_tile_pixels=64 * 64, tile_latent_size=8))
    assert not wants_tiling(small_vae, big, TilingOptions(auto_tile_pixels=100 * 100, tile_latent_size=8))
