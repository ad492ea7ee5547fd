"""The OpenAI-route tests' server (the session's shared `omnistage serve` of the shipped tiny
pipelines, tests/conftest.py), the official `openai` client pointed at it, and the same
pipelines through the Python API as the judge."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from omnistage.tests.serving.conftest import start_server


@contextmanager
def live_server(tmp_path_factory, args: list[str], env: dict[str, str] | None = None, timeout: float = 300):
    """`omnistage serve ARGS` with its own jobs folder and `env` added, ready, stopped after."""
    log_path = tmp_path_factory.mktemp("serve-api") / "server.log"
    extra = {"OMNISTAGE_JOBS_DIR": str(log_path.parent / "jobs"), **(env or {})}
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        server = start_server(args, log_path)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        server.wait_ready(timeout=timeout)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def api_server(tiny_server):
    """tiny-llm, tiny-image and tiny-image-previews behind HTTP: tests/conftest.py's shared
    server (it serves tiny-video and tiny-diamond too)."""
    return tiny_server


@pytest.fixture(scope="session")
def client(api_server):
    import openai

    return openai.OpenAI(base_url=api_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def llm_pipeline():
    from omnistage import Pipeline

    p = Pipeline.from_yaml("tiny-llm")
    yield p
    p.close()


@pytest.fixture(scope="session")
def tiny_llm_dir():
    from omnistage.models.recipes import build_recipe

    return build_recipe("tiny-llm")


# omni_server (tiny-omni behind HTTP: chat with audio, speech) is tests/conftest.py's shared
# server too


@pytest.fixture(scope="session")
def omni(omni_server):
    import openai

    return openai.OpenAI(base_url=omni_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def omni_pipeline():
    """tiny-omni through the Python API: the judge of the omni routes' tests (one for all)."""
    from omnistage import Pipeline

    with Pipeline.from_yaml("tiny-omni", ready_timeout=600) as p:
        yield p
