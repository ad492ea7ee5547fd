"""`omnistage serve` runs uvicorn on uvloop with the httptools parser (both dependencies):
the serving process has both extension modules loaded, and a streamed chat request read
with httpx works on them."""

from __future__ import annotations

from pathlib import Path

import httpx


def test_server_runs_on_uvloop_and_httptools(tiny_server):
    body = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    maps = Path(f"/proc/{tiny_server.proc.pid}/maps").read_text()
    libraries = {line.split()[-1] for line in maps.splitlines() if line.endswith(".so")}
    assert any("/uvloop/loop." in lib for lib in libraries), "uvloop is not loaded"
    assert any("/httptools/parser/parser." in lib for lib in libraries), "httptools is not loaded"
