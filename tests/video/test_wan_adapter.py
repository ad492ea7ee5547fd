"""Wan adapters driven by the step engine, in-process, against diffusers' WanPipeline."""

from __future__ import annotations

import torch

from omnistage.stages.diffusion.adapters import wan
from omnistage.stages.diffusion.adapters.base import GenerationParams, TextConditioning
from omnistage.stages.diffusion.step_engine import StepEngine

from .conftest import load_wan_components, reference_frames

REQUESTS = [
    dict(prompt="a cat walks on the grass", seed=1, num_inference_steps=3, height=32, width=32, num_frames=9),
    dict(
        prompt="a dog runs along the beach",
        negative_prompt="blurry",
        seed=2,
        num_inference_steps=5,
        height=32,
        width=32,
        num_frames=9,
    ),
    dict(prompt="waves crash", seed=3, num_inference_steps=4, height=32, width=48, num_frames=5, guidance_scale=1.0),
]


def test_engine_frames_equal_diffusers_and_chunked_decode_equals_at_once(tiny_wan_dir, wan_reference):
    comps = load_wan_components(tiny_wan_dir)
    run_and_compare(comps, wan_reference)


def test_unipc_scheduler_as_real_wan_checkpoints_ship(tiny_wan_dir):
    """Wan 2.1 Diffusers checkpoints use UniPC (flow prediction): multistep history per request."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    comps = load_wan_components(tiny_wan_dir)
    comps["scheduler"] = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000
    )
    reference = WanPipeline(**load_wan_components(tiny_wan_dir) | {"scheduler": comps["scheduler"]})
    reference.set_progress_bar_config(disable=True)
    run_and_compare(comps, reference)


def run_and_compare(comps, wan_reference):
    cpu = torch.device("cpu")
    text = wan.WanTextEncoder(comps, cpu, torch.float32)
    denoiser = wan.WanDenoiser(comps, cpu, torch.float32)
    vae = wan.WanVae(comps, cpu, torch.float32, {})
    engine = StepEngine(denoiser, max_batch_size=4)
    for i, raw in enumerate(REQUESTS):
        params = GenerationParams.from_dict(dict(raw, max_sequence_length=64))
        prompts = [params.prompt] + ([params.negative_prompt or ""] if text.uses_negative_prompt(params) else [])
        encoded = text.encode(prompts, 64)
        engine.add(denoiser.prepare(f"r{i}", params, TextConditioning(encoded.embeds)))
    finals = engine.run_until_done()
    # the two same-shape CFG requests shared transformer forwards
    assert any(set(rec.request_ids) == {"r0", "r1"} for rec in engine.step_log)

    for i, raw in enumerate(REQUESTS):
        latents = finals[f"r{i}"].latents
        chunks = list(vae.decode_chunks(latents, GenerationParams.from_dict(raw)))
        latent_frames = (raw["num_frames"] - 1) // 4 + 1
        assert [c.shape[0] for c in chunks] == [1] + [4] * (latent_frames - 1)
        frames = torch.cat(chunks)
        at_once = vae.decode_batch(latents)[0]
        assert torch.equal(frames, at_once)
        ref = reference_frames(
            wan_reference,
            prompt=raw["prompt"],
            negative_prompt=raw.get("negative_prompt"),
            height=raw["height"],
            width=raw["width"],
            num_frames=raw["num_frames"],
            steps=raw["num_inference_steps"],
            seed=raw["seed"],
            guidance_scale=raw.get("guidance_scale", 5.0),
        )[0]
        assert frames.shape == (raw["num_frames"], raw["height"], raw["width"], 3)
        assert (frames - ref).abs().max().item() < 1e-4  # float32 rounding; see test_wan_sensitivity.py


def test_temporal_chunks_equal_vae_decode_with_several_latent_frames_per_chunk(tiny_wan_dir):
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(tiny_wan_dir / "vae").eval()
    z = torch.randn(2, 16, 6, 4, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        at_once = vae.decode(z).sample
    for per_chunk in (1, 2, 4):
        chunks = list(wan.decode_wan_temporal_chunks(vae, z, per_chunk))
        assert len(chunks) == -(-6 // per_chunk)
        assert torch.equal(torch.cat(chunks, dim=2), at_once)


def test_bad_wan_parameters_are_invalid_requests(tiny_wan_dir):
    import pytest

    from omnistage.errors import InvalidRequestError

    comps = load_wan_components(tiny_wan_dir)
    denoiser = wan.WanDenoiser(comps, torch.device("cpu"), torch.float32)
    cond = TextConditioning(torch.zeros(2, 8, 32))
    for bad in (dict(height=40, width=32, num_frames=5), dict(height=32, width=32, num_frames=6)):
        with pytest.raises(InvalidRequestError):
            denoiser.prepare("x", GenerationParams.from_dict(dict(bad, prompt="p")), cond)


def test_interleaved_chunked_decodes_do_not_share_cache(tiny_wan_dir):
    """The VAE stage advances several videos one chunk each per step."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(tiny_wan_dir / "vae").eval()
    za = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    zb = torch.randn(1, 16, 4, 4, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref_a, ref_b = vae.decode(za).sample, vae.decode(zb).sample
    ga, gb = wan.decode_wan_temporal_chunks(vae, za), wan.decode_wan_temporal_chunks(vae, zb)
    parts_a, parts_b = [], []
    for _ in range(4):
        for gen, parts in ((ga, parts_a), (gb, parts_b)):
            chunk = next(gen, None)
            if chunk is not None:
                parts.append(chunk)
    assert (len(parts_a), len(parts_b)) == (3, 4)
    assert torch.equal(torch.cat(parts_a, dim=2), ref_a)
    assert torch.equal(torch.cat(parts_b, dim=2), ref_b)
