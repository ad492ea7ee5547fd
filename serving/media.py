"""Media outputs of the generic run endpoint: image, video and audio ports as files.

A client asks for a port's file format in one of two ways:
- `"output_format": {port: fmt}` in the JSON body (fmt a string, or an object such as
  `{"format": "mp4", "fps": 24}`): that port's value in the JSON answer becomes
  `{"media_type": ..., "b64_json": ...}` (a list of them for a batch of several images);
- an `Accept` header naming one media type (`image/png`, `video/mp4`, `audio/wav`, ...) on a
  pipeline with exactly one output port of that kind: the answer is the file itself.
The encoders are omnistage.streaming's.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from omnistage.errors import InvalidRequestError
from omnistage.streaming.audio import AUDIO_FORMATS, AUDIO_MEDIA_TYPES
from omnistage.streaming.images import IMAGE_FORMATS
from omnistage.streaming.images import MEDIA_TYPES as IMAGE_MEDIA_TYPES

VIDEO_MEDIA_TYPES = {"mp4": "video/mp4"}
# port type -> {format: media type}; the first format is the one an object without "format" gets
FORMATS_BY_PORT_TYPE: dict[str, dict[str, str]] = {
    "image": {f: IMAGE_MEDIA_TYPES[f] for f in IMAGE_FORMATS},
    "video": VIDEO_MEDIA_TYPES,
    "audio": {f: AUDIO_MEDIA_TYPES[f] for f in AUDIO_FORMATS},
}
# Wan 2.1 renders at 16 frames/s; the tiny audio models speak at Qwen2.5-Omni's 24 kHz.
DEFAULT_FPS = 16.0
DEFAULT_SAMPLE_RATE = 24_000
_OPTIONS = {"image": ("quality",), "video": ("fps",), "audio": ("sample_rate",)}


@dataclass(frozen=True)
class MediaFormat:
    port: str
    port_type: str  # image | video | audio
    format: str  # png, jpeg, webp, mp4, wav, ...
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def media_type(self) -> str:
        return FORMATS_BY_PORT_TYPE[self.port_type][self.format]

    def option(self, name: str, default: Any) -> Any:
        return dict(self.options).get(name, default)


def parse_output_formats(spec: Any, requested: dict[str, Any]) -> dict[str, MediaFormat]:
    """The body's `output_format` checked against the pipeline's output ports (400 otherwise)."""
    out = {}
    for port, value in requested.items():
        param = f"output_format.{port}"
        port_type = spec.outputs.get(port)
        if port_type is None:
            raise InvalidRequestError(
                f"output_format names {port!r}, which is not an output of this pipeline "
                f"(outputs: {', '.join(spec.outputs)})",
                param=param,
            )
        formats = FORMATS_BY_PORT_TYPE.get(port_type)
        if formats is None:
            raise InvalidRequestError(
                f"output {port!r} is {port_type}, not a media port (image, video or audio)", param=param
            )
        options = dict(value) if isinstance(value, dict) else {"format": value}
        fmt = options.pop("format", next(iter(formats)))
        if fmt == "jpg":
            fmt = "jpeg"
        if fmt not in formats:
            raise InvalidRequestError(
                f"{param}: {fmt!r} is not a {port_type} format; choose one of {', '.join(formats)}", param=param
            )
        unknown = set(options) - set(_OPTIONS[port_type])
        if unknown:
            raise InvalidRequestError(
                f"{param}: unknown option(s) {', '.join(sorted(unknown))} (allowed: {', '.join(_OPTIONS[port_type])})",
                param=param,
            )
        for name, number in options.items():
            if isinstance(number, bool) or not isinstance(number, (int, float)) or number <= 0:
                raise InvalidRequestError(f"{param}.{name} must be a positive number", param=f"{param}.{name}")
        if port_type == "image" and not 1 <= options.get("quality", 1) <= 100:
            raise InvalidRequestError(f"{param}.quality must lie in [1, 100]", param=f"{param}.quality")
        out[port] = MediaFormat(port, port_type, fmt, tuple(sorted(options.items())))
    return out


def format_for_accept(spec: Any, accept: str | None) -> MediaFormat | None:
    """A media type in the Accept header -> the one output port that can answer with it.

    The header's entries are taken in order (quality values are ignored): JSON is answered when
    `application/json` or `*/*` comes before any media type, or none is named; 406 when the
    first media type named is one no single output port of this pipeline gives.
    """
    if not accept:
        return None
    wanted = [part.split(";")[0].strip().lower() for part in accept.split(",")]
    for media_type in wanted:
        if media_type in ("application/json", "*/*", "application/*"):
            return None  # JSON is acceptable before any media type: answer JSON
        for port_type, formats in FORMATS_BY_PORT_TYPE.items():
            for fmt, known in formats.items():
                if known != media_type:
                    continue
                ports = [p for p, t in spec.outputs.items() if t == port_type]
                if len(ports) == 1:
                    return MediaFormat(ports[0], port_type, fmt)
                raise NotAcceptableError(
                    f"Accept: {media_type} needs exactly one {port_type} output; this pipeline has "
                    f'{len(ports)} ({", ".join(ports) or "none"}). Use "output_format" in the body instead.'
                )
    return None


class NotAcceptableError(InvalidRequestError):
    status = 406
    code = "not_acceptable"

    def __init__(self, message: str):
        super().__init__(message, param="Accept")


def encode_media(value: Any, media: MediaFormat) -> bytes | list[bytes]:
    """One port's value as file bytes (a list for a batch of several images)."""
    try:
        if media.port_type == "image":
            return _encode_image_value(value, media)
        if media.port_type == "video":
            from omnistage.streaming.video import encode_mp4

            return encode_mp4(value, fps=float(media.option("fps", DEFAULT_FPS)))
        from omnistage.streaming.audio import encode_audio

        return encode_audio(value, int(media.option("sample_rate", DEFAULT_SAMPLE_RATE)), media.format)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(
            f"output {media.port!r} cannot be encoded as {media.format}: {exc}", param=f"output_format.{media.port}"
        ) from exc


def _encode_image_value(value: Any, media: MediaFormat) -> bytes | list[bytes]:
    from omnistage.streaming.images import encode_image, encode_images

    quality = media.option("quality", None)
    shape = tuple(getattr(value, "shape", ()))
    if len(shape) == 4 and shape[0] > 1:
        return encode_images(value, media.format, quality=quality)
    return encode_image(value, media.format, quality=quality)


def media_json(value: Any, media: MediaFormat) -> dict[str, str] | list[dict[str, str]]:
    """A port's value for the JSON answer: base64 of the encoded file, with its media type."""
    encoded = encode_media(value, media)
    if isinstance(encoded, list):
        return [_b64(item, media) for item in encoded]
    return _b64(encoded, media)


def _b64(data: bytes, media: MediaFormat) -> dict[str, str]:
    return {"media_type": media.media_type, "b64_json": base64.b64encode(data).decode("ascii")}
