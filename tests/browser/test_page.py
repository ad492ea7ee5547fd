"""GET / and /static/*: the demo's files come from the package, open without the API key the
rest of the server wants; a missing file is an OpenAI-style 404, and paths cannot leave the
static folder. In Chromium, the page without the key says that the key is missing."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import httpx

from omnistage.tests.browser.conftest import AUTH, page_state, wait_for

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "serving" / "static"


def test_static_files_are_package_data():
    """An installed wheel carries every file of the page (pyproject's package-data)."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = globs.get("omnistage.serving", [])
    for path in STATIC.iterdir():
        relative = path.relative_to(ROOT / "serving").as_posix()
        assert any(fnmatch.fnmatch(relative, p) for p in patterns), f"{relative} is not in package-data"


def test_page_and_files_are_served_without_the_key(demo_server):
    with httpx.Client(base_url=demo_server.url, timeout=30) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.text == (STATIC / "index.html").read_text()
        for path in sorted(STATIC.iterdir()):
            response = client.get(f"/static/{path.name}")
            assert response.status_code == 200, path.name
            assert response.content == path.read_bytes()
        assert client.get("/static/app.js").headers["content-type"].startswith("text/javascript")
        # the key still guards everything else
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers=AUTH).status_code == 200

        missing = client.get("/static/nope.js")
        assert missing.status_code == 404 and missing.json()["error"]["message"]
        for escape in ("/static/../routes/demo.py", "/static/%2e%2e/routes/demo.py", "/static/..%2fauth.py"):
            response = client.get(escape)
            assert response.status_code == 404 or "def demo_page" not in response.text, escape


def test_page_without_the_key_says_so(demo_server, open_browser):
    driver = open_browser()
    driver.get(demo_server.url + "/")
    error = wait_for(driver, "window.demo && window.demo.error", 30, "the page's error")
    assert "API key" in error
    assert page_state(driver, "window.demo.ready") is False
