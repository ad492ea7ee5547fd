"""Diffusion defaults and size limits come from the checkpoint (stages/diffusion/limits.py).

Judges: the diffusers models themselves (the derived largest size runs through the real
transformer, one step more raises inside it), diffusers' StableDiffusion3Pipeline (its
default size for the same checkpoint), and a live server read with httpx (a request with
only a prompt succeeds at the default size; an out-of-range size is a 400 naming the
parameter, refused by the text encoder before the denoiser sees it).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from omnistage.graph.loader import load_pipeline
from omnistage.models.recipes import resolve_model
from omnistage.stages.diffusion.adapters import sd3, wan
from omnistage.stages.diffusion.limits import read_config


def _limits(recipe: str, family):
    root = resolve_model(f"tiny:{recipe}")
    return root, family.model_limits(read_config(root / "transformer"), read_config(root / "vae") or {})


def test_sd3_range_is_the_transformers_own():
    from diffusers import SD3Transformer2DModel

    root, limits = _limits("tiny-sd3", sd3)
    sizes = limits.sizes
    assert (sizes.max_height, sizes.max_width, sizes.height_multiple) == (256, 256, 4)
    model = SD3Transformer2DModel.from_pretrained(root / "transformer").eval()
    factor = sd3.vae_config_scale_factor(read_config(root / "vae"))  # diffusers' 2 ** (blocks - 1)

    def forward(height: int, width: int):
        latents = torch.zeros(1, model.config.in_channels, height // factor, width // factor)
        with torch.no_grad():
            return model(
                hidden_states=latents,
                timestep=torch.tensor([1.0]),
                encoder_hidden_states=torch.zeros(1, 4, model.config.joint_attention_dim),
                pooled_projections=torch.zeros(1, model.config.pooled_projection_dim),
            )

    forward(sizes.max_height, sizes.max_width)  # the largest size the limits allow runs
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        forward(sizes.max_height + sizes.height_multiple, sizes.max_width)


def test_sd3_default_is_diffusers_default():
    from diffusers import StableDiffusion3Pipeline

    root, limits = _limits("tiny-sd3", sd3)
    pipe = StableDiffusion3Pipeline.from_pretrained(root)
    want = pipe.default_sample_size * pipe.vae_scale_factor
    assert (limits.defaults.height, limits.defaults.width) == (want, want)


def test_wan_range_is_the_transformers_own():
    from omnistage.stages.diffusion.adapters.wan import load_wan_transformer

    root, limits = _limits("tiny-wan", wan)
    sizes = limits.sizes
    model = load_wan_transformer(root / "transformer")
    vae = read_config(root / "vae")
    temporal, spatial = vae["scale_factor_temporal"], vae["scale_factor_spatial"]  # as WanPipeline reads them

    def forward(frames: int, height: int, width: int):
        shape = (1, model.config.in_channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)
        latents = torch.zeros(shape)
        with torch.no_grad():
            return model(
                hidden_states=latents,
                timestep=torch.tensor([1.0]),
                encoder_hidden_states=torch.zeros(1, 4, model.config.text_dim),
            )

    step = sizes.width_multiple
    forward(1, step, sizes.max_width)
    forward(1, sizes.max_height, step)
    forward(sizes.max_frames, step, step)
    for bad in (
        (1, step, sizes.max_width + step),
        (1, sizes.max_height + step, step),
        (sizes.max_frames + 4, step, step),
    ):
        with pytest.raises(RuntimeError):
            forward(*bad)
    # the family default (WanPipeline's 480x832x81) is fitted into the range, aspect kept
    d = limits.defaults
    assert d.width == sizes.max_width and d.num_frames == 81
    assert d.height % sizes.height_multiple == 0 and abs(d.height / d.width - 480 / 832) < 0.03


@pytest.fixture(scope="module")
def server(tiny_server):
    """The session's `omnistage serve` of the shipped tiny pipelines (tests/conftest.py)."""
    return tiny_server


def _run(server, name: str, prompt: str, denoiser: dict | None = None) -> httpx.Response:
    params = {stage: dict(denoiser) for stage in ("text_encoder", "denoiser", "vae")} if denoiser else {}
    return httpx.post(
        f"{server.url}/v1/pipelines/{name}/run",
        json={"inputs": {"prompt": prompt}, "params": params},
        timeout=300,
    )


def test_image_with_only_a_prompt_has_the_model_default_size(server):
    _, limits = _limits("tiny-sd3", sd3)
    r = _run(server, "tiny-image", "a cat")
    assert r.status_code == 200, r.text
    image = np.asarray(r.json()["outputs"]["image"])
    assert image.shape == (1, limits.defaults.height, limits.defaults.width, 3)


def test_video_with_only_a_prompt_has_the_pipeline_default_size(server):
    stated = load_pipeline("tiny-video").stages["denoiser"].params["defaults"]
    _, limits = _limits("tiny-wan", wan)
    limits.sizes.check(stated["height"], stated["width"], stated["num_frames"])  # inside the model's range
    r = _run(server, "tiny-video", "a dog runs")
    assert r.status_code == 200, r.text
    video = np.asarray(r.json()["outputs"]["video"])
    assert video.shape == (stated["num_frames"], stated["height"], stated["width"], 3)


def test_listing_states_each_pipelines_defaults_and_range(server):
    _, sd3_limits = _limits("tiny-sd3", sd3)
    image = httpx.get(f"{server.url}/v1/pipelines/tiny-image", timeout=30).json()["stages"]["denoiser"]
    assert image["model_limits"]["height"] == sd3_limits.defaults.height
    assert image["model_limits"]["max_height"] == sd3_limits.sizes.max_height
    stated = load_pipeline("tiny-video").stages["denoiser"].params["defaults"]
    video = httpx.get(f"{server.url}/v1/pipelines/tiny-video", timeout=30).json()["stages"]["denoiser"]
    assert {k: video["model_limits"][k] for k in stated} == stated
    assert video["model_limits"]["max_frames"] == 125 and video["model_limits"]["frame_step"] == 4


def test_largest_image_the_limits_allow_is_served(server):
    r = _run(server, "tiny-image", "a cat", {"height": 256, "width": 256, "num_inference_steps": 1})
    assert r.status_code == 200, r.text
    assert np.asarray(r.json()["outputs"]["image"]).shape == (1, 256, 256, 3)


@pytest.mark.parametrize(
    "name, params, param",
    [
        ("tiny-image", {"height": 272, "width": 64}, "height"),
        ("tiny-image", {"height": 64, "width": 4096}, "width"),
        ("tiny-image", {"height": 64, "width": 66}, "width"),
        ("tiny-image", {"num_frames": 5}, "num_frames"),
        ("tiny-video", {"height": 32, "width": 528, "num_frames": 5}, "width"),
        ("tiny-video", {"height": 40, "width": 32, "num_frames": 5}, "height"),
        ("tiny-video", {"num_frames": 129}, "num_frames"),
        ("tiny-video", {"num_frames": 6}, "num_frames"),
    ],
)
def test_out_of_range_is_a_400_from_the_text_encoder(server, name, params, param):
    r = _run(server, name, "a cat", params)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith("stage 'text_encoder': "), error  # before the denoiser


def test_pipeline_defaults_are_checked(tmp_path):
    """A denoiser's `defaults` stage param: unknown keys are YAML problems at their position;
    a default outside the checkpoint's range stops the stage at start-up, naming it."""
    from omnistage.graph.loader import PipelineValidationError
    from omnistage.runtime.pipeline import Pipeline

    with pytest.raises(PipelineValidationError, match="unknown key 'heigth'"):
        load_pipeline("tiny-image", ["stages.denoiser.params.defaults={heigth: 32}"])
    spec = load_pipeline("tiny-image", ["stages.denoiser.params.defaults={height: 272}"])
    with pytest.raises(Exception, match=r"defaults\.height: height must be <= 256") as info:
        Pipeline.from_spec(spec, ready_timeout=120)
    assert "denoiser" in str(info.value)
