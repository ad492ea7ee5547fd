"""Chat messages (OpenAI's shape) -> the pipeline's input ports.

Text parts are joined into the message's text. `input_audio` and `image_url` parts go to the
`audio_in` / `images_in` roles' ports when the pipeline declares them: each becomes a
{"type": "audio"} / {"type": "image"} part in place and its encoded bytes an entry of that
port's list, in order. Media are decoded here first, so a bad one is a 400 naming its field.
Remote (http/https) image URLs are refused: the server fetches nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from omnistage.serving.routes.chat_models import AudioPart, ChatMessage, ImagePart, TextPart
from omnistage.serving.routes.served import Served, UnsupportedError, invalid


def decode_base64(data: str, param: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise invalid(f"{param} is not valid base64: {exc}", param, code="invalid_base64") from exc


def _image_bytes(part: ImagePart, param: str) -> bytes:
    url = part.image_url.url
    if url.startswith(("http://", "https://")):
        raise UnsupportedError("remote image URLs are not fetched; send a data: URL (base64)", param=param)
    if not url.startswith("data:") or ";base64," not in url:
        raise invalid("image_url.url must be a data:image/...;base64,... URL", param, code="invalid_image_url")
    data = decode_base64(url.split(";base64,", 1)[1], param)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise invalid(f"{param} is not a decodable image: {exc}", param, code="invalid_image") from exc
    return data


def _audio_bytes(part: AudioPart, param: str) -> bytes:
    data = decode_base64(part.input_audio.data, f"{param}.data")
    import soundfile

    try:
        soundfile.info(io.BytesIO(data))
    except (RuntimeError, soundfile.LibsndfileError) as exc:  # mp3/ogg that libsndfile cannot read: try PyAV
        if not _pyav_decodes(data):
            raise invalid(
                f"{param}.data is not decodable {part.input_audio.format} audio", f"{param}.data", code="invalid_audio"
            ) from exc
    return data


def _pyav_decodes(data: bytes) -> bool:
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            return any(True for _ in container.decode(audio=0))
    except (av.error.FFmpegError, ValueError, IndexError):
        return False


def pipeline_inputs(served: Served, messages: list[ChatMessage]) -> dict[str, Any]:
    audio_port, images_port = served.port("audio_in"), served.port("images_in")
    audio: list[bytes] = []
    images: list[bytes] = []
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if msg.tool_calls or msg.role == "tool":
            raise UnsupportedError("tool messages are not supported yet", param=f"{where}.role")
        role = "system" if msg.role == "developer" else msg.role
        if msg.content is None or isinstance(msg.content, str):
            out.append({"role": role, "content": msg.content or ""})
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(msg.content):
            param = f"{where}.content[{j}]"
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            elif isinstance(part, ImagePart):  # decoded first: a broken file is named on any model
                images.append(_image_bytes(part, f"{param}.image_url"))
                if images_port is None:
                    raise UnsupportedError(f"the model {served.name!r} takes no images", param=param)
                parts.append({"type": "image"})
            elif isinstance(part, AudioPart):
                audio.append(_audio_bytes(part, f"{param}.input_audio"))
                if audio_port is None:
                    raise UnsupportedError(f"the model {served.name!r} takes no audio", param=param)
                parts.append({"type": "audio"})
        if audio_port is None and images_port is None:
            out.append({"role": role, "content": "".join(p["text"] for p in parts)})
        else:
            out.append({"role": role, "content": parts})
    inputs: dict[str, Any] = {served.port("messages"): out}
    if audio:
        inputs[audio_port] = audio
    if images:
        inputs[images_port] = images
    return inputs
