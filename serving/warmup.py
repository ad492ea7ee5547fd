"""What a hosted pipeline's first requests would do once in the server's process, done before
the pipeline reports ready.

The server imports its output encoders lazily (PIL and its format plugins for images, PyAV for
audio codecs and video) and reads a diffusion checkpoint's size limits on the first queued
request that needs them. Done on first use, that work runs on threads that share the
interpreter lock with the event loop: the first job completions spent ~20-30 ms importing PIL,
and every request in flight waited for it. Warming runs on the registry's ready-waiter
thread, so no request waits for it; a failure here only leaves the work to the first request.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_TINY_IMAGE = np.zeros((8, 8, 3), dtype=np.uint8)


def warm_serving(spec: Any) -> None:
    """Import the encoders of `spec`'s output port types and cache its stages' checkpoint limits."""
    port_types = set(spec.outputs.values())
    if "image" in port_types:
        _warm_images()
    if "audio" in port_types or "video" in port_types:
        _try("import PyAV", lambda: __import__("av"))
    for stage in spec.stages.values():
        _try(f"read the limits of stage {stage.name!r}", lambda stage=stage: _stage_limits(stage))


def _warm_images() -> None:
    from omnistage.streaming.images import IMAGE_FORMATS, encode_image

    for fmt in IMAGE_FORMATS:  # each format's first save imports its PIL plugin
        _try(f"encode a {fmt} image", lambda fmt=fmt: encode_image(_TINY_IMAGE, fmt))


def _stage_limits(stage: Any) -> None:
    from omnistage.stages.diffusion.limits import stage_model_limits

    stage_model_limits(stage)


def _try(what: str, work) -> None:
    try:
        work()
    except Exception as exc:  # noqa: BLE001 - the first request does it instead, and reports it
        log.debug("warm-up could not %s: %s", what, exc)
