"""Image tensors -> PNG / JPEG / WebP bytes.

Accepted inputs (torch tensor or numpy array):
- uint8 in [0, 255], or float in [0, 1] (clipped, then rounded to uint8);
- HWC (channels last, 1/3/4 channels), CHW (channels first, as diffusers' "pt" output), or HW.
A leading batch dimension of size 1 is dropped; larger batches go through `encode_images`.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

IMAGE_FORMATS = ("png", "jpeg", "webp")
_PIL_FORMAT = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def to_numpy(array: Any) -> np.ndarray:
    """A CPU numpy view/copy of a torch tensor or array-like (no torch import needed)."""
    if hasattr(array, "detach"):  # torch.Tensor
        array = array.detach()
        if array.dtype.is_floating_point and array.dtype != _torch_float32():
            array = array.float()  # bfloat16/float16 have no numpy equivalent worth keeping
        array = array.cpu().numpy()
    return np.asarray(array)


def _torch_float32():
    import torch

    return torch.float32


def to_uint8(array: Any) -> np.ndarray:
    """uint8 values from uint8 or float [0, 1] data (round half to even, like torch/numpy)."""
    arr = to_numpy(array)
    if arr.dtype == np.uint8:
        return arr
    if np.issubdtype(arr.dtype, np.floating):
        return np.round(np.clip(arr, 0.0, 1.0) * 255.0).astype(np.uint8)
    if np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        if arr.min(initial=0) < 0 or arr.max(initial=0) > 255:
            raise ValueError("integer image values must lie in [0, 255]")
        return arr.astype(np.uint8)
    raise ValueError(f"unsupported image dtype {arr.dtype}")


def to_hwc_uint8(image: Any) -> np.ndarray:
    """One image as a contiguous (H, W, C) uint8 array with C in {1, 3, 4}."""
    arr = to_uint8(image)
    if arr.ndim == 4 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3:
        raise ValueError(f"expected one image (H,W,C), (C,H,W) or (H,W); got shape {arr.shape}")
    if arr.shape[-1] not in (1, 3, 4) and arr.shape[0] in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)  # CHW -> HWC
    if arr.shape[-1] not in (1, 3, 4):
        raise ValueError(f"image must have 1, 3 or 4 channels; got shape {arr.shape}")
    return np.ascontiguousarray(arr)


def normalize_format(fmt: str) -> str:
    fmt = fmt.lower()
    if fmt == "jpg":
        fmt = "jpeg"
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"unsupported image format {fmt!r}; choose one of {', '.join(IMAGE_FORMATS)}")
    return fmt


def encode_image(image: Any, fmt: str = "png", *, quality: int | None = None) -> bytes:
    """Encode one image. quality: 1-100 for JPEG/WebP (default 95 / 90); ignored for PNG.

    JPEG has no alpha: RGBA is flattened to RGB (alpha dropped). WebP with quality=100 is
    encoded lossless.
    """
    from PIL import Image

    fmt = normalize_format(fmt)
    arr = to_hwc_uint8(image)
    channels = arr.shape[-1]
    if channels == 1:
        pil = Image.fromarray(arr[:, :, 0], mode="L")
    elif channels == 3:
        pil = Image.fromarray(arr, mode="RGB")
    else:
        pil = Image.fromarray(arr, mode="RGBA")
        if fmt == "jpeg":
            pil = pil.convert("RGB")
    buf = io.BytesIO()
    options: dict[str, Any] = {}
    if fmt == "jpeg":
        options["quality"] = 95 if quality is None else int(quality)
    elif fmt == "webp":
        q = 90 if quality is None else int(quality)
        options.update(quality=q, lossless=q >= 100)
    else:
        options["compress_level"] = 6
    pil.save(buf, format=_PIL_FORMAT[fmt], **options)
    return buf.getvalue()


def encode_images(images: Any, fmt: str = "png", *, quality: int | None = None) -> list[bytes]:
    """Encode a batch: (N,H,W,C) / (N,C,H,W) array or tensor, or a list of single images."""
    if isinstance(images, (list, tuple)):
        return [encode_image(im, fmt, quality=quality) for im in images]
    arr = to_numpy(images)
    if arr.ndim == 3 and arr.shape[-1] not in (1, 3, 4) and arr.shape[0] not in (1, 3, 4):
        raise ValueError(f"ambiguous image batch of shape {arr.shape}")
    if arr.ndim == 4:
        return [encode_image(arr[i], fmt, quality=quality) for i in range(arr.shape[0])]
    return [encode_image(arr, fmt, quality=quality)]
