"""POST /v1/images/generations through the official `openai` client: the files decode with
Pillow at the asked size, and the same seed gives the same pixels as the Python API."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

STEPS = 2


@pytest.fixture(scope="module")
def image_pipeline():
    from omnistage import Pipeline

    p = Pipeline.from_yaml("tiny-image")
    yield p
    p.close()


def _decode(item) -> Image.Image:
    img = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
    img.load()
    return img


def test_png_pixels_equal_the_python_api(client, image_pipeline):
    reply = client.images.generate(
        model="tiny-image",
        prompt="a red square",
        n=2,
        size="64x48",
        extra_body={"seed": 3, "num_inference_steps": STEPS, "negative_prompt": "blue"},
    )
    assert len(reply.data) == 2
    images = [_decode(d) for d in reply.data]
    assert all(img.format == "PNG" and img.size == (64, 48) for img in images)
    fields = {"seed": 3, "num_inference_steps": STEPS, "negative_prompt": "blue", "width": 64, "height": 48}
    params = {stage: {**fields, "num_images_per_prompt": 2} for stage in ("text_encoder", "denoiser", "vae")}
    ours = image_pipeline.run({"prompt": "a red square"}, params, timeout=300)["image"]
    for i, img in enumerate(images):
        assert np.array_equal(np.asarray(img.convert("RGB")), np.asarray(ours[i]))
    assert not np.array_equal(np.asarray(images[0]), np.asarray(images[1]))


def test_a_truncated_prompt_is_said_in_the_answer_as_the_python_api_says_it(client, image_pipeline):
    prompt = " ".join(f"word{i}" for i in range(400))  # past every tiny text encoder's length
    fields = {"seed": 1, "num_inference_steps": STEPS}
    reply = client.images.generate(model="tiny-image", prompt=prompt, size="32x32", extra_body=fields)
    params = {stage: {**fields, "width": 32, "height": 32} for stage in ("text_encoder", "denoiser", "vae")}
    ours = image_pipeline.run({"prompt": prompt}, params, timeout=300)["warnings"]
    assert ours and reply.model_extra["warnings"] == list(ours)
    assert any("truncated" in w for w in ours)
    streamed = list(
        client.images.generate(model="tiny-image", prompt=prompt, size="32x32", stream=True, extra_body=fields)
    )
    assert streamed[-1].type == "image_generation.completed" and streamed[-1].model_extra["warnings"] == list(ours)
    short = client.images.generate(model="tiny-image", prompt="a cat", size="32x32", extra_body=fields)
    assert "warnings" not in (short.model_extra or {})  # nothing noted, nothing added


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_jpeg_and_webp_decode_at_the_size(client, fmt):
    reply = client.images.generate(
        model="tiny-image",
        prompt="a cat",
        size="32x32",
        output_format=fmt,
        output_compression=80,
        extra_body={"seed": 1, "num_inference_steps": STEPS},
    )
    img = _decode(reply.data[0])
    assert img.format == fmt.upper() and img.size == (32, 32)
    assert reply.output_format == fmt


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"size": "64by64"}, "size"),
        ({"size": "100000x64"}, "size"),
        ({"background": "transparent"}, "background"),
        ({"n": 11}, "n"),
    ],
)
def test_unservable_requests_name_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(model="tiny-image", prompt="x", **extra)
    assert info.value.body["param"] == param, info.value.body
