"""Fixtures for the video tests: the tiny-wan checkpoint and the diffusers reference pipeline."""

from __future__ import annotations

import pytest
import torch


def load_wan_components(model_dir):
    """Each component with its own library's loader. WanTransformer3DModel.from_pretrained needs
    `accelerate` (its fp32-kept modules force low_cpu_mem_usage), so it is built from its config
    and its safetensors weights are loaded strictly."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, UMT5EncoderModel

    transformer = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(model_dir / "transformer"))
    transformer.load_state_dict(load_file(model_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    return {
        "tokenizer": AutoTokenizer.from_pretrained(model_dir / "tokenizer"),
        "text_encoder": UMT5EncoderModel.from_pretrained(model_dir / "text_encoder").eval(),
        "transformer": transformer.eval(),
        "vae": AutoencoderKLWan.from_pretrained(model_dir / "vae").eval(),
        "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(model_dir / "scheduler"),
    }


@pytest.fixture(scope="session")
def tiny_wan_dir():
    from omnistage.models.recipes import build_recipe

    return build_recipe("tiny-wan")


@pytest.fixture(scope="session")
def wan_reference(tiny_wan_dir):
    """diffusers WanPipeline on the tiny checkpoint."""
    from diffusers import WanPipeline

    pipe = WanPipeline(**load_wan_components(tiny_wan_dir))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_frames(
    pipe,
    *,
    prompt,
    negative_prompt=None,
    height,
    width,
    num_frames,
    steps,
    seed,
    guidance_scale=5.0,
    max_sequence_length=64,
    n=1,
):
    """[n, F, H, W, 3] float frames in [0, 1] from diffusers."""
    out = pipe(
        prompt,
        negative_prompt=negative_prompt,
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=steps,
        guidance_scale=guidance_scale,
        num_videos_per_prompt=n,
        generator=torch.Generator().manual_seed(seed),
        max_sequence_length=max_sequence_length,
        output_type="pt",
    ).frames
    return out.permute(0, 1, 3, 4, 2).float()  # [n, F, 3, H, W] -> channels last
