"""A real `omnistage serve tiny-llm` for the streaming tests over HTTP (one per session)."""

from __future__ import annotations

import pytest

from ..serving.conftest import start_server


@pytest.fixture(scope="session")
def llm_server(tmp_path_factory):
    server = start_server(["tiny-llm"], tmp_path_factory.mktemp("serve-llm") / "server.log")
    try:
        server.wait_ready(timeout=180)
        yield server
    finally:
        server.stop()
