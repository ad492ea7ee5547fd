"""POST /v1/images/edits through the official `openai` client (multipart upload): the edited
image equals diffusers' StableDiffusion3Img2ImgPipeline on the same tiny checkpoint, seed and
strength, and a masked edit its StableDiffusion3InpaintPipeline; refusals name their field."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

PROMPT = "a red house by a lake"


@pytest.fixture(scope="module")
def init_png() -> bytes:
    rng = np.random.default_rng(5)
    ys, xs = np.mgrid[0:32, 0:48]
    pixels = np.stack([ys * 7, xs * 5, (ys + xs) * 3], axis=-1) % 256
    pixels = (pixels + rng.integers(0, 40, pixels.shape)).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def img2img_reference():
    from diffusers import StableDiffusion3Img2ImgPipeline

    from omnistage.models.recipes import build_recipe

    pipe = StableDiffusion3Img2ImgPipeline.from_pretrained(build_recipe("tiny-sd3"), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def run(png: bytes, seed: int, **params) -> np.ndarray:
        image = Image.open(io.BytesIO(png)).convert("RGB")
        gen = torch.Generator("cpu").manual_seed(seed)
        return np.stack([np.asarray(im) for im in pipe(PROMPT, image=image, generator=gen, **params).images])

    return run


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


ALPHA = np.full((32, 48), 255, np.uint8)
ALPHA[6:26, 10:34] = 0  # transparent: repaint (OpenAI's mask convention)
MASK_PNG = _png(np.dstack([np.full((32, 48, 3), 90, np.uint8), ALPHA]))


@pytest.fixture(scope="module")
def inpaint_reference():
    from diffusers import StableDiffusion3InpaintPipeline

    from omnistage.models.recipes import build_recipe

    pipe = StableDiffusion3InpaintPipeline.from_pretrained(build_recipe("tiny-sd3"), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    # The pipeline takes its latent-blending branch for transformers of 16 input channels (SD3's
    # own, no mask channels) and refuses other counts; the tiny VAE has 4 latent channels. The
    # transformer's forward never reads config.in_channels, so declaring 16 selects that branch.
    pipe.transformer.register_to_config(in_channels=16)

    def run(png: bytes, seed: int, **params) -> np.ndarray:
        image = Image.open(io.BytesIO(png)).convert("RGB")
        repaint = Image.fromarray(255 - ALPHA)  # diffusers' convention: white = repaint
        gen = torch.Generator("cpu").manual_seed(seed)
        latents = pipe(PROMPT, image=image, mask_image=repaint, generator=gen, output_type="latent", **params).images
        # decoded as diffusers' SD3 text-to-image and img2img pipelines decode (this one leaves
        # out the VAE's shift_factor, which the tiny VAE has)
        cfg = pipe.vae.config
        with torch.no_grad():
            pixels = pipe.vae.decode(latents / cfg.scaling_factor + cfg.shift_factor, return_dict=False)[0]
        return np.stack([np.asarray(im) for im in pipe.image_processor.postprocess(pixels)])

    return run


def _decoded(item) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json))).convert("RGB"))


def _assert_same_pixels(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    diff = np.abs(ours.astype(int) - ref.astype(int))
    # float32 rounding (~1e-6 on [0, 1]) may flip a value sitting on a rounding boundary
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())


def test_edit_equals_diffusers_img2img(client, init_png, img2img_reference):
    extra = {"seed": 11, "strength": 0.7, "num_inference_steps": 5, "guidance_scale": 4.0}
    reply = client.images.edit(
        model="tiny-image", image=("in.png", init_png, "image/png"), prompt=PROMPT, n=2, extra_body=extra
    )
    assert reply.size == "48x32"  # size auto: the input image's
    ours = np.stack([_decoded(d) for d in reply.data])
    ref = img2img_reference(
        init_png,
        11,
        strength=0.7,
        num_inference_steps=5,
        guidance_scale=4.0,
        num_images_per_prompt=2,
        height=32,
        width=48,
    )
    _assert_same_pixels(ours, ref)
    weaker = img2img_reference(
        init_png, 11, strength=0.3, num_inference_steps=5, guidance_scale=4.0, height=32, width=48
    )
    assert np.abs(weaker[0].astype(int) - ours[0].astype(int)).max() > 8  # strength reaches the denoiser


@pytest.mark.parametrize(("given", "made"), [((50, 30), (48, 28)), ((1000, 600), (256, 152))])
def test_any_input_size_is_edited_at_the_nearest_size_the_model_makes(client, given, made):
    """As diffusers' img2img rounds an image's size down to its multiples: 50x30 becomes 48x28
    (multiples of 4), and 1000x600 is scaled into the tiny model's 256 pixels, aspect kept."""
    pixels = np.random.default_rng(1).integers(0, 256, (given[1], given[0], 3), dtype=np.uint8)
    reply = client.images.edit(
        model="tiny-image", image=("in.png", _png(pixels), "image/png"), prompt=PROMPT,
        extra_body={"seed": 1, "num_inference_steps": 2},
    )  # fmt: skip
    assert reply.size == f"{made[0]}x{made[1]}"
    assert _decoded(reply.data[0]).shape == (made[1], made[0], 3)


def test_streamed_edit_sends_image_edit_events(client, init_png):
    events = list(
        client.images.edit(
            model="tiny-image-previews",
            image=("in.png", init_png, "image/png"),
            prompt=PROMPT,
            stream=True,
            partial_images=1,
            extra_body={"seed": 2, "strength": 0.9, "num_inference_steps": 4},
        )
    )
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert all(e.size == "48x32" for e in events)


def test_masked_edit_equals_diffusers_inpaint(client, init_png, inpaint_reference, img2img_reference):
    extra = {"seed": 7, "strength": 0.8, "num_inference_steps": 5, "guidance_scale": 4.0}
    reply = client.images.edit(
        model="tiny-image",
        image=("in.png", init_png, "image/png"),
        mask=("mask.png", MASK_PNG, "image/png"),
        prompt=PROMPT,
        n=2,
        extra_body=extra,
    )
    ours = np.stack([_decoded(d) for d in reply.data])
    params = dict(strength=0.8, num_inference_steps=5, guidance_scale=4.0, height=32, width=48)
    _assert_same_pixels(ours, inpaint_reference(init_png, 7, num_images_per_prompt=2, **params))
    unmasked = img2img_reference(init_png, 7, **params)[0]
    assert np.abs(unmasked.astype(int) - ours[0].astype(int)).max() > 8  # the mask reaches the denoiser


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"mask": ("m.png", b"\x89PNG", "image/png")}, "mask"),
        ({"mask": ("m.png", _png(np.zeros((32, 40, 4), np.uint8)), "image/png")}, "mask"),  # not the image's size
        ({"mask": ("m.png", _png(np.zeros((32, 48, 3), np.uint8)), "image/png")}, "mask"),  # no alpha
        ({"image": ("in.png", b"not an image", "image/png")}, "image"),
        ({"model": "tiny-llm"}, "model"),
        ({"size": "33x32"}, "size"),
        ({"extra_body": {"strength": 1.5}}, "strength"),
        ({"extra_body": {"strength": 0.0}}, "strength"),
    ],
)
def test_unservable_edits_name_the_field(client, init_png, kwargs, param):
    args = {"model": "tiny-image", "image": ("in.png", init_png, "image/png"), "prompt": PROMPT, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.images.edit(**args)
    assert info.value.body["param"] == param, info.value.body


def test_a_json_edit_is_told_the_route_takes_multipart(api_server):
    body = {"model": "tiny-image", "prompt": PROMPT, "image": "data:image/png;base64,AAAA"}
    r = httpx.post(api_server.url + "/v1/images/edits", json=body, timeout=60)
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"], r.text
