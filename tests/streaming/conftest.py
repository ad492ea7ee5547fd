"""The streaming tests' `omnistage serve` over HTTP: the session's shared tiny server."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def llm_server(tiny_server):
    """tiny-llm behind HTTP: tests/conftest.py's `omnistage serve tiny-llm tiny-image tiny-video`
    (these tests filter what they read from /metrics by pipeline)."""
    return tiny_server
