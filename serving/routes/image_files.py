"""Images answered with `response_format: "url"`: files kept for a retention period and served
at `GET /v1/images/files/{name}`.

The files live in `<jobs directory>/images/` (the jobs directory of serving/jobs: one place
for what the server writes; OMNISTAGE_JOBS_DIR moves both), each named by a random 128-bit
id, so a URL cannot be guessed. A file older than OMNISTAGE_IMAGE_URL_TTL_S (default one
hour, as OpenAI's image URLs) is answered 404 and deleted at the next write. The route sits
behind the same API-key check as every other route and answers only the key that asked for the
image (another key gets 404, as for a file that does not exist).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from omnistage.errors import NotFoundError
from omnistage.serving.jobs.owners import owner_of
from omnistage.serving.media import FORMATS_BY_PORT_TYPE

router = APIRouter(tags=["openai"])

TTL_ENV = "OMNISTAGE_IMAGE_URL_TTL_S"
DEFAULT_TTL_S = 3600.0
EXTENSIONS = {"png": "png", "jpeg": "jpg", "webp": "webp"}
MEDIA_TYPES = {ext: FORMATS_BY_PORT_TYPE["image"][fmt] for fmt, ext in EXTENSIONS.items()}


class ImageFileStore:
    """Encoded images on disk, each readable until `ttl_s` after it was written."""

    def __init__(self, directory: Path, ttl_s: float):
        self.directory = directory
        self.ttl_s = ttl_s

    @classmethod
    def from_env(cls) -> ImageFileStore:
        from omnistage.serving.jobs.model import JobsConfig

        ttl = float(os.environ.get(TTL_ENV) or DEFAULT_TTL_S)
        return cls(JobsConfig.from_env().directory / "images", ttl)

    def put(self, data: bytes, output_format: str) -> str:
        """Write one file; returns its name. Expired files are swept first."""
        self.sweep()
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"{uuid.uuid4().hex}.{EXTENSIONS[output_format]}"
        tmp = self.directory / f".{name}.tmp"
        try:
            tmp.write_bytes(data)
            tmp.replace(self.directory / name)  # a reader never sees a half-written file
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk keeps no partial file
            raise
        return name

    def expires_at(self, name: str) -> float | None:
        path = self._path(name)
        return None if path is None else path.stat().st_mtime + self.ttl_s

    def path(self, name: str) -> Path | None:
        """The file `name` while it is within its retention period, else None."""
        path = self._path(name)
        if path is None or path.stat().st_mtime + self.ttl_s < time.time():
            return None
        return path

    def _path(self, name: str) -> Path | None:
        stem, _, ext = name.partition(".")
        if ext not in MEDIA_TYPES or len(stem) != 32 or not all(c in "0123456789abcdef" for c in stem):
            return None
        path = self.directory / name
        return path if path.is_file() else None

    def sweep(self) -> None:
        if not self.directory.is_dir():
            return
        limit = time.time() - self.ttl_s
        for path in self.directory.iterdir():
            try:
                if path.stat().st_mtime < limit:
                    path.unlink()
            except FileNotFoundError:
                pass  # swept by a concurrent request


def image_store(request: Request) -> ImageFileStore:
    """The app's store, made on first use (the environment is read once per app)."""
    store = getattr(request.app.state, "image_files", None)
    if store is None:
        store = request.app.state.image_files = ImageFileStore.from_env()
    return store


def image_url(request: Request, name: str) -> str:
    """The file's URL; with API keys configured, the file is readable with this request's key only."""
    owner = owner_of(request)
    if owner is not None:  # written before the URL is answered, so no reader comes first
        (image_store(request).directory / f".{name}.owner").write_text(owner)
    return str(request.url_for("image_file", name=name))


def _owned_by(request: Request, path: Path) -> bool:
    owner = owner_of(request)
    if owner is None:
        return True
    marker = path.with_name(f".{path.name}.owner")
    return marker.is_file() and marker.read_text() == owner


@router.get("/v1/images/files/{name}", name="image_file", response_class=FileResponse)
async def image_file(name: str, request: Request):
    path = image_store(request).path(name)
    if path is None or not _owned_by(request, path):  # another key's file is as absent as a missing one
        raise NotFoundError(f"no image file {name!r} (image URLs expire after their retention period)")
    return FileResponse(path, media_type=MEDIA_TYPES[path.suffix[1:]])
