"""What an `image` input accepts (stages/diffusion/img2img.py): Pillow decodes and builds the
images; anything else is a 400-style error that names what was given."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.errors import InvalidRequestError
from omnistage.stages.diffusion.img2img import image_and_mask


def png_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def test_every_accepted_form_gives_the_same_pixels():
    pixels = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    for given in (pixels, torch.from_numpy(pixels)[None], png_bytes(pixels), Image.fromarray(pixels)):
        image, mask = image_and_mask(given)
        assert mask is None and np.array_equal(np.asarray(image), pixels)
    rgba = np.concatenate([pixels, np.full((6, 5, 1), 255, np.uint8)], axis=-1)
    rgba[0, 0, 3] = 0  # transparent: repaint here
    image, mask = image_and_mask(rgba)
    assert np.array_equal(np.asarray(image), pixels) and np.asarray(mask)[0, 0] == 255 and np.asarray(mask)[1, 1] == 0


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("notanimage", "got a string"),
        ("/tmp/cat.png", "PIL.Image.open reads a file"),
        (b"not a png", "not a decodable image"),
        (np.zeros((4, 4, 3), np.float32), "got float32 [4, 4, 3]"),
        (np.zeros((4, 4), np.uint8), "got uint8 [4, 4]"),
    ],
)
def test_other_values_are_refused_naming_what_was_given(given, said):
    with pytest.raises(InvalidRequestError) as err:
        image_and_mask(given)
    assert said in str(err.value) and err.value.param == "image"
