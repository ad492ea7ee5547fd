"""Image encoders, judged by decoding the bytes back with Pillow."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.streaming.images import encode_image, encode_images


def _smooth_rgb(h=48, w=64, seed=0):
    # A smooth image (what lossy codecs are meant for) with a little noise.
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx / w, yy / h, (xx + yy) / (w + h)], axis=-1)
    noise = np.random.default_rng(seed).normal(0, 0.01, base.shape)
    return np.clip(base + noise, 0, 1).astype(np.float32)


def _decode(data: bytes) -> tuple[str, np.ndarray]:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im.format, np.asarray(im)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_png_uint8_hwc_roundtrips_exactly():
    img = np.random.default_rng(1).integers(0, 256, (17, 23, 3), dtype=np.uint8)
    fmt, back = _decode(encode_image(img, "png"))
    assert fmt == "PNG"
    np.testing.assert_array_equal(back, img)


def test_png_float_chw_tensor_rounds_to_uint8():
    img = torch.rand(3, 20, 30, generator=torch.Generator().manual_seed(0))
    img[0, 0, 0] = 1.3  # out of range values clip
    img[1, 0, 0] = -0.2
    fmt, back = _decode(encode_image(img, "png"))
    expected = np.round(np.clip(img.permute(1, 2, 0).numpy(), 0, 1) * 255).astype(np.uint8)
    assert back.shape == (20, 30, 3)
    np.testing.assert_array_equal(back, expected)


def test_png_rgba_and_grayscale():
    rgba = np.random.default_rng(2).integers(0, 256, (8, 9, 4), dtype=np.uint8)
    _, back = _decode(encode_image(rgba, "png"))
    np.testing.assert_array_equal(back, rgba)
    gray = np.random.default_rng(3).integers(0, 256, (8, 9), dtype=np.uint8)
    _, back = _decode(encode_image(gray, "png"))
    np.testing.assert_array_equal(back, gray)


def test_bfloat16_batch_of_one():
    img = torch.rand(1, 16, 16, 3, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    _, back = _decode(encode_image(img, "png"))
    expected = np.round(img[0].float().numpy() * 255).astype(np.uint8)
    np.testing.assert_array_equal(back, expected)


@pytest.mark.parametrize(
    "fmt,pil_name,min_psnr", [("jpeg", "JPEG", 35.0), ("jpg", "JPEG", 35.0), ("webp", "WEBP", 35.0)]
)
def test_lossy_formats_stay_close(fmt, pil_name, min_psnr):
    img = _smooth_rgb()
    decoded_fmt, back = _decode(encode_image(img, fmt))
    assert decoded_fmt == pil_name
    assert back.shape == img.shape
    assert _psnr(back, np.round(img * 255)) >= min_psnr


def test_webp_quality_100_is_lossless():
    img = np.random.default_rng(5).integers(0, 256, (12, 10, 3), dtype=np.uint8)
    _, back = _decode(encode_image(img, "webp", quality=100))
    np.testing.assert_array_equal(back, img)


def test_jpeg_lower_quality_is_smaller_and_worse():
    img = _smooth_rgb(seed=6)
    hi, lo = encode_image(img, "jpeg", quality=95), encode_image(img, "jpeg", quality=20)
    assert len(lo) < len(hi)
    ref = np.round(img * 255)
    assert _psnr(_decode(lo)[1], ref) < _psnr(_decode(hi)[1], ref)


def test_batch_encoding_nchw():
    batch = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    out = encode_images(batch, "png")
    assert len(out) == 3
    for i, data in enumerate(out):
        expected = np.round(batch[i].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
        np.testing.assert_array_equal(_decode(data)[1], expected)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="format"):
        encode_image(np.zeros((4, 4, 3), np.uint8), "gif")
    with pytest.raises(ValueError, match="channels"):
        encode_image(np.zeros((6, 7, 5), np.uint8), "png")
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        encode_image(np.full((4, 4, 3), 300, np.int32), "png")
