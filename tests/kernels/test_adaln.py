"""The fused adaLN-modulate kernel vs diffusers' arithmetic, alone and inside real SD3 and FLUX
transformers whose norms it replaces (TRITON_INTERPRET=1, see conftest)."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from diffusers.models.normalization import AdaLayerNormZero, AdaLayerNormZeroSingle

from omnistage.kernels.triton import adaln
from omnistage.stages.diffusion.adapters.base import DenoiserAdapter
from omnistage.stages.diffusion.fused_norms import (
    FusedAdaLayerNormZero,
    FusedAdaLayerNormZeroSingle,
    fuse_adaln,
    unfuse_adaln,
)

from .conftest import TOL


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("tokens,hidden", [(1, 40), (7, 96), (33, 48)])
def test_kernel_matches_diffusers_arithmetic(dtype, tokens, hidden):
    """Hidden sizes that are not powers of two (padded lanes must not count in the statistics);
    shift and scale are strided chunks of one projection, as AdaLayerNormZero makes them."""
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(tokens)
    x = (2 * torch.randn(3, tokens, hidden, generator=g) + 0.5).to(dt)
    emb = (0.5 * torch.randn(3, 6 * hidden, generator=g)).to(dt)
    shift, scale = emb.chunk(6, dim=1)[:2]
    assert not shift.is_contiguous()
    got = adaln.ada_layer_norm(x, shift, scale, 1e-6)
    # float16: the reference rounds the normalized rows before modulating, the kernel once at
    # the end: ~2 ulp of values up to ~6 (|normed| ~3 times 1 + scale)
    tol = TOL[dtype] if dt == torch.float32 else dict(atol=1e-2, rtol=2e-3)
    torch.testing.assert_close(got, adaln.ada_layer_norm_ref(x, shift, scale, 1e-6), **tol)
    if dt == torch.float16:  # and closer to the exact value than the reference is
        exact = adaln.ada_layer_norm_ref(x.double(), shift.double(), scale.double(), 1e-6)
        err_kernel = (got.double() - exact).abs().max()
        err_ref = (adaln.ada_layer_norm_ref(x, shift, scale, 1e-6).double() - exact).abs().max()
        assert err_kernel <= err_ref


def _sd3() -> SD3Transformer2DModel:
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16,
        pos_embed_max_size=16,
    ).eval()  # fmt: skip


def _flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    ).eval()  # fmt: skip


def _sd3_forward(model):
    g = torch.Generator().manual_seed(1)
    return model(
        hidden_states=torch.randn(2, 4, 8, 8, generator=g),
        encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
        pooled_projections=torch.randn(2, 16, generator=g),
        timestep=torch.tensor([500.0, 20.0]),
    ).sample


def _flux_forward(model):
    g = torch.Generator().manual_seed(1)
    return model(
        hidden_states=torch.randn(2, 16, 16, generator=g),
        encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
        pooled_projections=torch.randn(2, 16, generator=g),
        timestep=torch.tensor([0.5, 0.02]),
        guidance=torch.tensor([3.5, 3.5]),
        img_ids=torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1
        ).reshape(16, 3),
        txt_ids=torch.zeros(5, 3),
    ).sample


@pytest.mark.parametrize(
    "build,forward,expected",
    [
        # SD3: each block's norm1, and norm1_context except in the last block (AdaLayerNormContinuous)
        (_sd3, _sd3_forward, {FusedAdaLayerNormZero: 3}),
        # FLUX: the double block's norm1 and norm1_context, each single block's norm
        (_flux, _flux_forward, {FusedAdaLayerNormZero: 2, FusedAdaLayerNormZeroSingle: 2}),
    ],
    ids=["sd3", "flux"],
)
def test_fused_norms_give_the_transformers_outputs(build, forward, expected):
    model = build()
    plain = {AdaLayerNormZero: 0, AdaLayerNormZeroSingle: 0}
    for m in model.modules():
        if type(m) in plain:
            plain[type(m)] += 1
    with torch.no_grad():
        reference = forward(model)
        assert fuse_adaln(model) == sum(expected.values()) == sum(plain.values())
        assert {cls: sum(type(m) is cls for m in model.modules()) for cls in expected} == expected
        torch.testing.assert_close(forward(model), reference, **TOL["float32"])
        assert unfuse_adaln(model) == sum(expected.values())
        assert not any(isinstance(m, (FusedAdaLayerNormZero, FusedAdaLayerNormZeroSingle)) for m in model.modules())
        assert torch.equal(forward(model), reference)


@pytest.mark.parametrize("setting,fused", [("1", 3), ("0", 0)])
def test_the_denoiser_fuses_when_the_kernels_are_selected(monkeypatch, setting, fused):
    """OMNISTAGE_TRITON as for the AR engine: on CUDA by default, "1" anywhere, "0" never."""
    monkeypatch.setenv("OMNISTAGE_TRITON", setting)
    model = _sd3()
    DenoiserAdapter({"transformer": model, "scheduler": None}, torch.device("cpu"), torch.float32)
    assert sum(type(m) is FusedAdaLayerNormZero for m in model.modules()) == fused


def test_what_the_kernel_does_not_cover_runs_diffusers_code():
    """A conditioning row broadcast over the batch, another dtype, or a forward that wants
    gradients (the kernel has none) give diffusers' own result."""
    torch.manual_seed(0)
    plain = AdaLayerNormZero(16)
    fused = AdaLayerNormZero(16)
    fused.load_state_dict(plain.state_dict())
    assert fuse_adaln(fused) == 1
    x = torch.randn(2, 5, 16, requires_grad=True)
    emb = torch.randn(2, 16)
    out = fused(x, emb=emb)[0]
    torch.testing.assert_close(out, plain(x, emb=emb)[0], atol=0, rtol=0)
    out.sum().backward()
    assert x.grad is not None and fused.linear.weight.grad is not None
    with torch.no_grad():
        one_row = torch.randn(1, 16)
        torch.testing.assert_close(fused(x, emb=one_row)[0], plain(x, emb=one_row)[0], atol=0, rtol=0)
        torch.testing.assert_close(fused(x, emb=emb)[0], plain(x, emb=emb)[0], **TOL["float32"])
