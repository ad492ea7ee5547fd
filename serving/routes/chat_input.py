"""Chat messages (OpenAI's shape) -> the pipeline's input ports.

Text parts are joined into the message's text. `input_audio`, `image_url` and `video_url` parts
go to the `audio_in` / `images_in` / `videos_in` roles' ports when the pipeline declares them:
each becomes a {"type": "audio"} / {"type": "image"} / {"type": "video"} part in place and its
encoded bytes an entry of that port's list, in order (videos are checked by chat_video.py). Media are decoded here first, so a bad one is a 400 naming its field.
Remote (http/https) image URLs are refused: the server fetches nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable
from typing import Any

from omnistage.serving.routes.chat_models import AudioPart, ChatMessage, ImagePart, TextPart, VideoPart
from omnistage.serving.routes.chat_video import video_bytes
from omnistage.serving.routes.served import Served, UnsupportedError, invalid
from omnistage.stages.media_limits import MAX_AUDIO_SECONDS, check_audio_size, image_problem, open_image


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
    from PIL import UnidentifiedImageError

    try:
        with open_image(data, param) as img:
            img.verify()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise invalid(f"{param} is not a decodable image: {image_problem(exc)}", param, code="invalid_image") from exc
    return data


def _audio_bytes(part: AudioPart, param: str) -> bytes:
    data = decode_base64(part.input_audio.data, f"{param}.data")
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
        rate, seconds = info.samplerate, info.duration
    except (RuntimeError, soundfile.LibsndfileError) as exc:  # mp3/ogg that libsndfile cannot read: try PyAV
        found = _pyav_rate_and_seconds(data)
        if found is None:
            raise invalid(
                f"{param}.data is not decodable {part.input_audio.format} audio", f"{param}.data", code="invalid_audio"
            ) from exc
        rate, seconds = found
    check_audio_size(rate, seconds, f"{param}.data")
    return data


def _pyav_rate_and_seconds(data: bytes) -> tuple[int, float] | None:
    """(sample rate, seconds) of the first audio stream, None when it does not decode; stops
    decoding as soon as the audio is longer than allowed."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            rate = container.streams.audio[0].codec_context.sample_rate or 0
            samples = 0
            for frame in container.decode(audio=0):
                samples += frame.samples
                if rate and samples / rate > MAX_AUDIO_SECONDS:
                    break
            return (rate, samples / rate if rate else 0.0) if samples else None
    except (av.error.FFmpegError, ValueError, IndexError):
        return None


def _referred_reply(msg: ChatMessage, where: str, transcripts: Callable[[str], str | None] | None) -> str:
    """The transcript an assistant turn's `audio: {id}` stands for."""
    if msg.content:
        raise invalid("an assistant message carries content or audio, not both", f"{where}.content")
    param = f"{where}.audio.id"
    transcript = transcripts(msg.audio.id) if transcripts is not None else None
    if transcript is None:
        transcript = msg.audio.transcript
    if transcript is None:
        raise invalid(
            f"no spoken reply {msg.audio.id!r} is known to this key (unknown, or past its expires_at)",
            param,
            code="invalid_value",
        )
    return transcript


def pipeline_inputs(
    served: Served,
    messages: list[ChatMessage],
    audio_in_video: bool = False,
    transcripts: Callable[[str], str | None] | None = None,
) -> dict[str, Any]:
    """The pipeline's inputs; with `audio_in_video` each video is also the next audio entry
    (the encoder decodes its sound track), where the text stage expects it. `transcripts`
    resolves an assistant turn's `audio: {id}` to the spoken reply's transcript."""
    audio_port, images_port, videos_port = served.port("audio_in"), served.port("images_in"), served.port("videos_in")
    audio: list[bytes] = []
    images: list[bytes] = []
    videos: list[bytes] = []
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if msg.tool_calls or msg.role == "tool":
            raise UnsupportedError("tool messages are not supported yet", param=f"{where}.role")
        role = "system" if msg.role == "developer" else msg.role
        if msg.audio is not None:
            out.append({"role": role, "content": _referred_reply(msg, where, transcripts)})
            continue
        if msg.content is None or isinstance(msg.content, str):
            out.append({"role": role, "content": msg.content or msg.refusal or ""})  # a refusal is what was said
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
            elif isinstance(part, VideoPart):  # the model first: checking a video costs a decode
                if videos_port is None:
                    raise UnsupportedError(f"the model {served.name!r} takes no videos", param=param)
                videos.append(video_bytes(part, f"{param}.video_url"))
                if audio_in_video:
                    if _pyav_rate_and_seconds(videos[-1]) is None:
                        raise invalid(
                            "mm_processor_kwargs.use_audio_in_video: this video has no sound track",
                            f"{param}.video_url",
                            code="invalid_video",
                        )
                    audio.append(videos[-1])
                parts.append({"type": "video"})
        if audio_port is None and images_port is None and videos_port is None:
            out.append({"role": role, "content": "".join(p["text"] for p in parts)})
        else:
            out.append({"role": role, "content": parts})
    inputs: dict[str, Any] = {served.port("messages"): out}
    if audio:
        inputs[audio_port] = audio
    if images:
        inputs[images_port] = images
    if videos:
        inputs[videos_port] = videos
    return inputs
