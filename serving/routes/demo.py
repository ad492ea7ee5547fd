"""The browser demo (docs/demo.md): GET / is the page, GET /static/{file} its scripts and style.

Plain files shipped in the package (serving/static/), no build step and nothing fetched from
elsewhere at run time. The page talks to the server's own public routes only: /v1/models and
/v1/pipelines for its pickers, WS /v1/realtime for the talk tab, /v1/jobs for images and video.
Both paths are open without an API key (serving/auth.py): they hold no data, and the page
asks for the key and sends it on its own requests.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
STATIC_URL = "/static"

router = APIRouter(tags=["demo"])
_files = StaticFiles(directory=STATIC_DIR)
# The page and its scripts change with the package: let a browser revalidate them on each load.
_NO_STALE = {"cache-control": "no-cache"}


@router.get("/", include_in_schema=False)
async def demo_page() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_NO_STALE)


@router.get(STATIC_URL + "/{path:path}", include_in_schema=False)
async def demo_file(path: str, request: Request):
    response = await _files.get_response(path, request.scope)
    response.headers.update(_NO_STALE)
    if path.endswith(".js"):  # module scripts need a JavaScript type, whatever the system's mime.types says
        response.headers["content-type"] = "text/javascript; charset=utf-8"
    return response
