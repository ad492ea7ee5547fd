"""A finished job's output ports as files under the outputs directory.

Media ports (image, video, audio) are encoded with the format the job asked for in
`output_format` (serving/media.py; default: PNG, MP4, WAV) and written to
`<outputs>/<job id>/<port>[_<i>].<ext>`; a batch of images gives one file each. Other ports
(text, json, small tensors) stay in the job record as JSON values.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from omnistage.serving.media import FORMATS_BY_PORT_TYPE, MediaFormat, encode_media, parse_output_formats

EXTENSIONS = {"jpeg": "jpg"}


def output_formats(spec: Any, requested: dict[str, Any]) -> dict[str, MediaFormat]:
    """Every media output port's format: the requested one, else its port type's first."""
    formats = parse_output_formats(spec, requested)
    for port, port_type in spec.outputs.items():
        if port not in formats and port_type in FORMATS_BY_PORT_TYPE:
            formats[port] = MediaFormat(port, port_type, next(iter(FORMATS_BY_PORT_TYPE[port_type])))
    return formats


def write_outputs(
    job_id: str,
    outputs: dict[str, Any],
    formats: dict[str, MediaFormat],
    directory: Path,
    prebuilt: dict[str, bytes] | None = None,
) -> dict[str, Any]:
    """Encode and write the media ports; returns the job record's `outputs` entries:
    {"files": [{"name", "media_type", "bytes"}]} per media port, the JSON value otherwise.
    `prebuilt`: ports already encoded (a video muxed while it streamed)."""
    from omnistage.serving.routes.pipelines import to_jsonable

    job_dir = directory / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {}
    for port, value in outputs.items():
        media = formats.get(port)
        if media is None or value is None:
            record[port] = to_jsonable(value)
            continue
        encoded = (prebuilt or {}).get(port) or encode_media(value, media)
        items = encoded if isinstance(encoded, list) else [encoded]
        ext = EXTENSIONS.get(media.format, media.format)
        files = []
        for i, data in enumerate(items):
            name = f"{port}.{ext}" if len(items) == 1 else f"{port}_{i}.{ext}"
            tmp = job_dir / f".{name}.tmp"
            tmp.write_bytes(data)
            tmp.replace(job_dir / name)  # a reader never sees a half-written file
            files.append({"name": name, "media_type": media.media_type, "bytes": len(data)})
        record[port] = {"files": files}
    return record


def output_files(outputs: dict[str, Any]) -> list[dict[str, Any]]:
    """Every file record ({name, media_type, bytes}) of a job's stored outputs."""
    return [f for value in outputs.values() if isinstance(value, dict) for f in value.get("files", ())]


def output_path(directory: Path, job_id: str, name: str) -> Path | None:
    """The file `name` of job `job_id`, or None when it is absent or the name leaves the job's folder."""
    job_dir = (directory / job_id).resolve()
    path = (job_dir / name).resolve()
    if path.parent != job_dir or not path.is_file():
        return None
    return path


def delete_outputs(directory: Path, job_id: str) -> None:
    shutil.rmtree(directory / job_id, ignore_errors=True)
