"""Fuzzing the live HTTP API of `omnistage serve tiny-llm tiny-image`:

- schemathesis (its own CLI, the real tool) generates requests for every operation in the
  server's /openapi.json, a few examples each, plus its coverage and stateful phases: no 5xx
  answer, no request running past 30 s;
- hypothesis sends chat completions, completions, image generations and image edits
  (multipart, with valid, odd-sized and undecodable images and masks) to the real models
  with arbitrary values for their request fields, and pipeline runs and jobs with arbitrary
  per-stage params (the names each stage declares, read from GET /v1/pipelines/{name}, plus
  unknown ones): each is answered with a result or a 400 with an OpenAI-style error naming
  the parameter, never 5xx; a job with params its stage kind does not declare is refused
  when submitted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from omnistage.bench.soak_traffic import IMAGE
from omnistage.tests.api.conftest import live_server
from omnistage.tests.jobs.conftest import wait_status
from omnistage.tests.reliability.fuzz_values import anything, asks_to_stream, assert_served_or_named_400, capped

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
@example({"seed": 2**64})  # past what torch's generators take
@example({"seed": -(2**63) - 1})
@example({"stream": 1})  # a lax boolean: streamed
def test_chat_params_are_served_or_refused_with_a_named_parameter(server, params):
    body = capped({"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **params})
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert_served_or_named_400(
        r, params, streamed=asks_to_stream(body.get("stream")), final_event="[DONE]", result_key="choices"
    )


COMPLETION_FIELDS = [
    "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "best_of", "echo",
    "suffix", "logprobs", "stop", "stop_token_ids", "seed", "min_tokens", "ignore_eos",
    "repetition_penalty", "logit_bias", "stream", "stream_options",
]  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.dictionaries(st.sampled_from(COMPLETION_FIELDS), anything, min_size=1, max_size=4))
@example({"seed": 2**64})
def test_completion_fields_are_served_or_refused_with_a_named_parameter(server, fields):
    body = capped({"model": "tiny-llm", "prompt": "once upon", "max_tokens": 4, **fields})
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert_served_or_named_400(
        r, fields, streamed=asks_to_stream(body.get("stream")), final_event="[DONE]", result_key="choices"
    )


IMAGE_FIELDS = [
    "prompt", "n", "size", "response_format", "output_format", "output_compression", "background",
    "quality", "style", "stream", "partial_images", "negative_prompt", "num_inference_steps",
    "guidance_scale", "seed", "user",
]  # fmt: skip
image_value = st.one_of(
    anything,
    st.sampled_from(["64x64", "auto", "0x0", "64x65", "-64x64", "64X64", "99999x99999", "1x1", " 64x64"]),
    st.sampled_from(["png", "jpeg", "webp", "url", "b64_json", "transparent", "hd"]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.dictionaries(st.sampled_from(IMAGE_FIELDS), image_value, min_size=1, max_size=4))
@example({"stream": True, "partial_images": 1})
@example({"seed": 2**64})
def test_image_fields_are_served_or_refused_with_a_named_parameter(server, fields):
    body = capped({**IMAGE, "num_inference_steps": 2, **fields})
    r = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)
    streamed = asks_to_stream(body.get("stream"))
    assert_served_or_named_400(
        r, fields, streamed=streamed, final_event="image_generation.completed", result_key="data"
    )


EDIT_FIELDS = [
    "prompt", "n", "size", "response_format", "output_format", "output_compression", "background",
    "quality", "input_fidelity", "stream", "partial_images", "strength", "negative_prompt",
    "num_inference_steps", "guidance_scale", "seed", "user", "unknown_field",
]  # fmt: skip
form_value = st.one_of(
    st.text(max_size=12),
    st.integers(min_value=-(2**40), max_value=2**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),  # a form field is text: "nan" and "inf" too
    st.sampled_from(["64x64", "auto", "0x0", "true", "false", "url", "jpeg", "webp", "high", "0.5", ""]),
)


def png(width: int, height: int, mode: str = "RGB", alpha: int = 255) -> bytes:
    import io

    from PIL import Image

    color = (200, 40, 40) if mode == "RGB" else (200, 40, 40, alpha)
    out = io.BytesIO()
    Image.new(mode, (width, height), color).save(out, format="PNG")
    return out.getvalue()


upload = st.one_of(
    st.tuples(st.integers(1, 96), st.integers(1, 96)).map(lambda wh: png(*wh)),
    st.binary(max_size=64),  # not an image
    st.just(png(64, 64)),
)
mask_upload = st.one_of(
    st.none(),
    st.just(png(64, 64, "RGBA", alpha=0)),  # the right size, all transparent
    st.just(png(32, 32, "RGBA", alpha=0)),  # another size
    st.just(png(64, 64)),  # no alpha channel
    st.binary(max_size=32),
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.dictionaries(st.sampled_from(EDIT_FIELDS), form_value, max_size=4), upload, mask_upload)
@example({"stream": "true"}, png(64, 64), png(64, 64, "RGBA", alpha=0))
def test_image_edit_fields_are_served_or_refused_with_a_named_parameter(server, fields, image, mask):
    data = capped({"model": "tiny-image", "prompt": "a blue square", "num_inference_steps": "2", **fields})
    files = {"image": ("in.png", image, "image/png")}
    if mask is not None:
        files["mask"] = ("mask.png", mask, "image/png")
    r = httpx.post(f"{server.url}/v1/images/edits", data=data, files=files, timeout=120)
    sent = (fields, len(image), mask is not None)
    assert_served_or_named_400(
        r, sent, streamed=data.get("stream") == "true", final_event="image_edit.completed", result_key="data"
    )


@pytest.fixture(scope="module")
def stage_params(server) -> dict[str, dict[str, list[str]]]:
    """{pipeline: {stage: [declared request param names]}} as GET /v1/pipelines/{name} lists them."""
    out = {}
    for name in ("tiny-llm", "tiny-image"):
        card = httpx.get(f"{server.url}/v1/pipelines/{name}", timeout=30).json()
        out[name] = {stage: [p["name"] for p in about["params"]] for stage, about in card["stages"].items()}
        assert all(out[name].values()), card  # the fuzz below draws from these names
    return out


@st.composite
def pipeline_params(draw, stage_params):
    """(pipeline, {stage: {param: value}}): declared names mostly, unknown stages and keys
    sometimes, a stage's params now and then not an object at all."""
    pipeline = draw(st.sampled_from(sorted(stage_params)))
    stages = stage_params[pipeline]
    params: dict = {}
    for stage in draw(st.lists(st.sampled_from([*stages, "no_such_stage"]), min_size=1, max_size=3, unique=True)):
        names = st.sampled_from([*stages.get(stage, []), "no_such_param"])
        if draw(st.integers(0, 9)) == 0:
            params[stage] = draw(anything)
        else:
            params[stage] = capped(draw(st.dictionaries(names, image_value, min_size=1, max_size=3)))
    return pipeline, params


INPUTS = {"tiny-llm": {"prompt": "hello"}, "tiny-image": {"prompt": "a red square"}}
SMALL = {"tiny-llm": {"llm": {"max_tokens": 4}}, "tiny-image": {"denoiser": {"width": 64, "height": 64, "num_inference_steps": 2}}}  # fmt: skip


def merged(pipeline: str, params: dict) -> dict:
    out = {stage: dict(values) for stage, values in SMALL[pipeline].items()}
    for stage, values in params.items():
        out[stage] = {**out.get(stage, {}), **values} if isinstance(values, dict) else values
    return out


def test_pipeline_params_are_served_or_refused_with_a_named_parameter(server, stage_params):
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(pipeline_params(stage_params))
    def run(drawn):
        pipeline, params = drawn
        body = {"inputs": INPUTS[pipeline], "params": merged(pipeline, params)}
        r = httpx.post(f"{server.url}/v1/pipelines/{pipeline}/run", json=body, timeout=120)
        assert_served_or_named_400(r, params, streamed=False, result_key="outputs")

    run()


def test_job_params_are_refused_at_once_or_by_their_stage(server, stage_params):
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(pipeline_params(stage_params))
    @example(("tiny-image", {"denoiser": {"width": 66}}))  # not a multiple of the model's 4: the stage's
    @example(("tiny-image", {"vae": {"widht": 64}}))
    @example(("tiny-image", {"text_encoder": {"": 0}}))
    def run(drawn):
        pipeline, params = drawn
        body = {"model": pipeline, "inputs": INPUTS[pipeline], "params": merged(pipeline, params)}
        r = httpx.post(f"{server.url}/v1/jobs", json=body, timeout=60)
        assert r.status_code in (202, 400), (params, r.status_code, r.text[:500])
        if r.status_code == 400:
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"], (params, error)
            return
        with httpx.Client(base_url=server.url, timeout=30) as client:
            job = wait_status(client, r.json()["id"], ("completed", "failed", "canceled"))
        # what only the stage knows (its model's size range, its max_inference_steps) fails
        # the job when it runs, with the stage's own 400 error
        if job["status"] != "completed":
            error = job["error"]
            assert job["status"] == "failed" and error["code"] == "invalid_value" and error["message"], job
            declared = {name for names in stage_params[pipeline].values() for name in names}
            assert error.get("param") in declared, (params, job)  # an undeclared one is refused at once

    run()
