"""Fuzzing the live HTTP API of `omnistage serve tiny-llm tiny-image`:

- schemathesis (its own CLI, the real tool) generates requests for every operation in the
  server's /openapi.json, a few examples each, plus its coverage and stateful phases: no 5xx
  answer, no request running past 30 s;
- hypothesis sends chat completions to the real model with arbitrary values for every
  sampling parameter: each is answered 200 with a completion or 400 with an OpenAI-style
  error naming the parameter, never 5xx."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnistage.tests.api.conftest import live_server

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory, ["tiny-llm", "tiny-image"]) as server:
        yield server


def test_schemathesis_finds_no_server_error(server, tmp_path):
    run = subprocess.run(
        [
            str(SCHEMATHESIS),
            "run",
            f"{server.url}/openapi.json",
            "--max-examples",
            "3",
            "--checks",
            "not_a_server_error",
            "--request-timeout",
            "30",
            "--seed",
            "1",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    report = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    assert " passed" in report and "generated" in report, report


anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False),  # JSON has neither
    st.text(max_size=12),
    st.lists(st.text(max_size=5), max_size=6),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
PARAMS = [
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "stream",
    "response_format",
    "user",
]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.dictionaries(st.sampled_from(PARAMS), anything, min_size=1, max_size=4))
def test_chat_params_are_served_or_refused_with_a_named_parameter(server, params):
    body = {"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **params}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
        body["max_tokens"] = 64  # a valid huge value is not abuse, only slow
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = 4
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code in (200, 400), (params, r.status_code, r.text[:500])
    if r.status_code == 400:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"] and error["param"], error
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    else:
        assert r.json()["choices"], r.text[:300]
