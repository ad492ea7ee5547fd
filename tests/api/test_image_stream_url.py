"""/v1/images/generations with `response_format: "url"` and with `stream: true`, through the
official `openai` client. Judges: the b64_json answer for the same seed (url), diffusers'
StableDiffusion3Pipeline trajectory on the same checkpoint (partial images are its clean-latent
estimate at the chosen steps, decoded by its VAE; the completed image is its output)."""

from __future__ import annotations

import base64
import io
import os
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

PROMPT = "a lighthouse at dawn"
GEN = {"seed": 4, "num_inference_steps": 6, "guidance_scale": 4.0}


def _png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _assert_same_pixels(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    diff = np.abs(ours.astype(int) - ref.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())


def test_url_serves_the_same_png_as_b64(client, api_server):
    args = dict(model="tiny-image", prompt=PROMPT, size="48x32", n=2, extra_body=GEN)
    by_url = client.images.generate(response_format="url", **args)
    inline = client.images.generate(**args)
    assert all(d.b64_json is None and d.url.startswith(api_server.url + "/v1/images/files/") for d in by_url.data)
    for item, expected in zip(by_url.data, inline.data):
        r = httpx.get(item.url, timeout=30)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(r.content))), _png(expected.b64_json))
    missing = httpx.get(api_server.url + "/v1/images/files/" + "0" * 32 + ".png", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(api_server.url + "/v1/images/files/..%2Fjobs.sqlite3", timeout=30).status_code == 404


def test_image_files_expire_after_their_retention(tmp_path):
    from omnistage.serving.routes.image_files import ImageFileStore

    store = ImageFileStore(tmp_path, ttl_s=60)
    old, fresh = store.put(b"old", "png"), store.put(b"fresh", "jpeg")
    assert store.path(old).read_bytes() == b"old" and fresh.endswith(".jpg")
    past = time.time() - 61
    os.utime(tmp_path / old, (past, past))
    assert store.path(old) is None and store.path(fresh) is not None
    store.put(b"next", "webp")  # a write sweeps what expired
    assert not (tmp_path / old).exists() and (tmp_path / fresh).exists()


@pytest.fixture(scope="module")
def sd3_trajectory():
    """diffusers' latents after every step, its sigmas, its image and its VAE decode."""
    from diffusers import StableDiffusion3Pipeline

    from omnistage.models.recipes import build_recipe

    pipe = StableDiffusion3Pipeline.from_pretrained(build_recipe("tiny-sd3"), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    seen: list[torch.Tensor] = []

    def keep(_pipe, _i, _t, tensors):
        seen.append(tensors["latents"].clone())
        return {}

    gen = torch.Generator("cpu").manual_seed(GEN["seed"])
    out = pipe(
        PROMPT,
        height=32,
        width=48,
        num_inference_steps=GEN["num_inference_steps"],
        guidance_scale=GEN["guidance_scale"],
        generator=gen,
        output_type="pil",
        callback_on_step_end=keep,
    )

    @torch.no_grad()
    def decode(latents: torch.Tensor) -> np.ndarray:
        cfg = pipe.vae.config
        image = pipe.vae.decode(latents / cfg.scaling_factor + cfg.shift_factor, return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1)[0].permute(1, 2, 0).mul(255).round().to(torch.uint8).numpy()

    return seen, pipe.scheduler.sigmas.clone(), np.asarray(out.images[0]), decode


def test_partial_images_are_the_denoisers_decoded_estimates(client, sd3_trajectory):
    seen, sigmas, final, decode = sd3_trajectory
    events = list(
        client.images.generate(
            model="tiny-image-previews", prompt=PROMPT, size="48x32", stream=True, partial_images=2, extra_body=GEN
        )
    )
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(e.size == "48x32" and e.output_format == "png" for e in events)
    # 6 steps, 2 partials: estimates made at steps 1 and 3 (0-based), x0 = x_j - sigma_j * v_j,
    # with diffusers' velocity recovered from its Euler update x_{j+1} = x_j + (sigma_{j+1} - sigma_j) v_j
    for event, j in zip(events[:2], (1, 3)):
        velocity = (seen[j] - seen[j - 1]) / (sigmas[j + 1] - sigmas[j])
        _assert_same_pixels(_png(event.b64_json), decode(seen[j - 1] - sigmas[j] * velocity))
    _assert_same_pixels(_png(events[-1].b64_json), final)
    assert np.abs(_png(events[0].b64_json).astype(int) - final.astype(int)).max() > 8


def test_stream_without_partials_and_its_refusals(client):
    events = list(client.images.generate(model="tiny-image", prompt=PROMPT, size="32x32", stream=True, extra_body=GEN))
    assert [e.type for e in events] == ["image_generation.completed"]
    for kwargs, param in (
        ({"model": "tiny-image", "partial_images": 1}, "partial_images"),  # no preview port
        ({"model": "tiny-image-previews", "partial_images": 1, "n": 2}, "n"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            list(client.images.generate(prompt=PROMPT, stream=True, **kwargs))
        assert info.value.body["param"] == param, info.value.body
