"""Wan: how strong the frame comparison with diffusers is, and mixed settings in one forward.

The Wan adapters driven by the step engine agree with diffusers' WanPipeline to float32
rounding on [0, 1] frames, so TOL = 1e-4 keeps two orders of margin for BLAS-path differences.
The sensitivity floor: the reference frames themselves move by at least FLOOR (10 x TOL) when
the step count, prompt, guidance or one timestep changes, so an engine that got any of these
wrong for one request cannot pass.
"""

from __future__ import annotations

import functools

import pytest
import torch

from omnistage.stages.diffusion.adapters import wan
from omnistage.stages.diffusion.adapters.base import GenerationParams, TextConditioning
from omnistage.stages.diffusion.step_engine import StepEngine

from .conftest import load_wan_components, reference_frames

TOL = 1e-4
FLOOR = 10 * TOL
MSL = 64
BASE = dict(prompt="a cat walks on the grass", seed=1, num_inference_steps=3, height=32, width=32, num_frames=5)


@pytest.fixture(scope="module")
def wan_kit(tiny_wan_dir):
    comps = load_wan_components(tiny_wan_dir)
    cpu = torch.device("cpu")
    return (
        wan.WanTextEncoder(comps, cpu, torch.float32),
        wan.WanDenoiser(comps, cpu, torch.float32),
        wan.WanVae(comps, cpu, torch.float32, {}),
    )


def run_engine(kit, requests: dict[str, dict]):
    """Every request added before the first step; returns (frames per request, engine)."""
    text, denoiser, vae = kit
    engine = StepEngine(denoiser, max_batch_size=8)
    for rid, raw in requests.items():
        params = GenerationParams.from_dict(dict(raw, max_sequence_length=MSL))
        prompts = [params.prompt] + ([params.negative_prompt or ""] if text.uses_negative_prompt(params) else [])
        encoded = text.encode(prompts, MSL)
        engine.add(denoiser.prepare(rid, params, TextConditioning(encoded.embeds)))
    finals = engine.run_until_done()
    frames = {rid: vae.decode_batch(finals[rid].latents)[0] for rid in requests}
    return frames, engine


def reference(pipe, raw: dict) -> torch.Tensor:
    return reference_frames(
        pipe,
        prompt=raw["prompt"],
        negative_prompt=raw.get("negative_prompt"),
        height=raw["height"],
        width=raw["width"],
        num_frames=raw["num_frames"],
        steps=raw["num_inference_steps"],
        seed=raw["seed"],
        guidance_scale=raw.get("guidance_scale", 5.0),
        max_sequence_length=MSL,
    )[0]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_frames_agree_tightly_and_the_reference_is_sensitive(wan_kit, wan_reference, monkeypatch):
    frames, _ = run_engine(wan_kit, {"r": BASE})
    base = reference(wan_reference, BASE)
    assert base.shape == (5, 32, 32, 3)
    # real spread, not flat or clamped, and frames that differ from one another
    assert base.std() > 0.05 and ((base <= 0) | (base >= 1)).float().mean() < 0.05
    assert (base[0] - base[-1]).abs().max() > FLOOR
    assert max_err(frames["r"], base) <= TOL

    moved = {
        "steps": max_err(reference(wan_reference, dict(BASE, num_inference_steps=4)), base),
        "prompt": max_err(reference(wan_reference, dict(BASE, prompt="a dog runs on the beach")), base),
        "guidance": max_err(reference(wan_reference, dict(BASE, guidance_scale=6.0)), base),
    }
    original = wan_reference.scheduler.set_timesteps

    @functools.wraps(original)  # diffusers inspects the signature
    def one_timestep_off(*args, **kwargs):
        original(*args, **kwargs)
        timesteps = wan_reference.scheduler.timesteps.clone()
        timesteps[1] += 10.0  # of 1000
        wan_reference.scheduler.timesteps = timesteps

    monkeypatch.setattr(wan_reference.scheduler, "set_timesteps", one_timestep_off)
    moved["one timestep"] = max_err(reference(wan_reference, BASE), base)
    monkeypatch.undo()
    assert all(v >= FLOOR for v in moved.values()), moved


def test_mixed_guidance_negatives_steps_seeds_share_forwards(wan_kit, wan_reference):
    requests = {
        "g5_neg": dict(BASE, guidance_scale=5.0, negative_prompt="blurry", num_inference_steps=4, seed=2),
        "g3_neg": dict(BASE, guidance_scale=3.0, negative_prompt="dark, low quality", num_inference_steps=3, seed=3),
        "g5_plain": dict(BASE, prompt="snow falls on a forest", guidance_scale=5.0, num_inference_steps=2, seed=4),
        "nocfg": dict(BASE, prompt="waves crash on rocks", guidance_scale=1.0, num_inference_steps=5, seed=5),
    }
    frames, engine = run_engine(wan_kit, requests)
    together = [rec for rec in engine.step_log if set(rec.request_ids) == set(requests)]
    assert together, [rec.request_ids for rec in engine.step_log]
    # one forward fed each request its own schedule's timestep
    assert any(len(set(rec.extra["timesteps"])) == len(requests) for rec in together)
    assert together[0].extra["rows"] == 2 + 2 + 2 + 1  # CFG rows only where guidance > 1
    for rid, raw in requests.items():
        assert max_err(frames[rid], reference(wan_reference, raw)) <= TOL, rid
