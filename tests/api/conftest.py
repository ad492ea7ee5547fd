"""One live `omnistage serve tiny-llm tiny-image` for the OpenAI-route tests, the official
`openai` client pointed at it, and the same pipelines through the Python API as the judge."""

from __future__ import annotations

import os

import pytest

from omnistage.tests.serving.conftest import start_server


@pytest.fixture(scope="session")
def api_server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve-api") / "server.log"
    saved = os.environ.get("OMNISTAGE_JOBS_DIR")
    os.environ["OMNISTAGE_JOBS_DIR"] = str(log_path.parent / "jobs")
    try:
        server = start_server(["tiny-llm", "tiny-image"], log_path)
    finally:
        if saved is None:
            os.environ.pop("OMNISTAGE_JOBS_DIR", None)
        else:
            os.environ["OMNISTAGE_JOBS_DIR"] = saved
    try:
        server.wait_ready(timeout=300)
        yield server
    finally:
        server.stop()


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
