"""Components load from a diffusers directory, a component subfolder, or per-component paths."""

from __future__ import annotations

import torch

from omnistage.stages.diffusion.loading import build_adapter, detect_family, stage_root


def ctx_for(make_ctx, kind, model_path, params=None):
    ctx = make_ctx(kind, model_path or ".", params=params)
    ctx.model_path = None if model_path is None else str(model_path)
    return ctx


def test_family_detection(sd3_dir, flux_dir):
    assert detect_family(sd3_dir, {}) == "sd3"
    assert detect_family(flux_dir, {}) == "flux"
    assert detect_family(None, {"components": {"transformer": str(flux_dir / "transformer")}}) == "flux"
    assert stage_root(sd3_dir / "transformer") == sd3_dir


def test_per_component_paths_equal_the_diffusers_directory(sd3_dir, make_ctx_fn):
    whole = build_adapter(ctx_for(make_ctx_fn, "text_encoder", sd3_dir), "TEXT_ENCODER")
    names = ["tokenizer", "tokenizer_2", "tokenizer_3", "text_encoder", "text_encoder_2", "text_encoder_3"]
    split = build_adapter(
        ctx_for(
            make_ctx_fn, "text_encoder", None, {"family": "sd3", "components": {n: str(sd3_dir / n) for n in names}}
        ),
        "TEXT_ENCODER",
    )
    a = whole.encode(["a photo of a cat"], 24)
    b = split.encode(["a photo of a cat"], 24)
    assert torch.equal(a.embeds, b.embeds) and torch.equal(a.pooled, b.pooled)
    # a denoiser pointed at its component subfolder finds the rest through model_index.json
    dn = build_adapter(ctx_for(make_ctx_fn, "denoiser", sd3_dir / "transformer"), "DENOISER")
    assert dn.family == "sd3" and dn.vae_scale_factor == 2
