"""GET /v1/pipelines and /v1/pipelines/{name} on a live server: ports with types, each stage's
per-request params (from the stage kinds' declarations) and an example request that runs."""

from __future__ import annotations

import httpx
import pytest

from omnistage.graph.loader import load_pipeline
from omnistage.stages.params import kind_params


def test_list_names_every_pipeline_with_its_ports(tiny_server):
    r = httpx.get(tiny_server.url + "/v1/pipelines", timeout=10)
    assert r.status_code == 200
    cards = {c["id"]: c for c in r.json()["data"]}
    assert set(cards) == {"tiny-llm", "tiny-image", "tiny-image-previews", "tiny-video", "tiny-diamond", "tiny-omni"}
    for name, card in cards.items():
        spec = load_pipeline(name)  # the judge: the YAML file itself
        assert {p: i["type"] for p, i in card["inputs"].items()} == spec.inputs
        assert {p: o["type"] for p, o in card["outputs"].items()} == spec.outputs
        assert card["ready"] is True


def test_detail_lists_stage_params_with_type_range_default(tiny_server):
    card = httpx.get(tiny_server.url + "/v1/pipelines/tiny-llm", timeout=10).json()
    llm = card["stages"]["llm"]
    assert llm["kind"] == "ar_lm"
    declared = {p.name: p for p in kind_params("ar_lm").request}
    listed = {p["name"]: p for p in llm["params"]}
    assert set(listed) == set(declared)
    assert listed["max_tokens"]["type"] == declared["max_tokens"].type
    assert listed["max_tokens"]["default"] == declared["max_tokens"].default
    assert listed["max_tokens"]["range"] == declared["max_tokens"].range_text()
    assert card["outputs"]["text"]["streamed"] is True and card["outputs"]["info"]["streamed"] is False
    image = httpx.get(tiny_server.url + "/v1/pipelines/tiny-image", timeout=10).json()
    assert image["outputs"]["image"]["formats"] == ["png", "jpeg", "webp"]


@pytest.mark.parametrize("name", ["tiny-llm", "tiny-image"])
def test_example_request_runs(tiny_server, name):
    card = httpx.get(f"{tiny_server.url}/v1/pipelines/{name}", timeout=10).json()
    example = card["example_request"]
    assert example is not None
    r = httpx.post(f"{tiny_server.url}/v1/pipelines/{name}/run", json=example, timeout=300)
    assert r.status_code == 200, r.text
    assert set(r.json()["outputs"]) == set(card["outputs"])


def test_unknown_pipeline_is_404(tiny_server):
    r = httpx.get(tiny_server.url + "/v1/pipelines/nope", timeout=10)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_tensor_input_example_follows_the_declared_shape(tiny_server):
    card = httpx.get(tiny_server.url + "/v1/pipelines/tiny-diamond", timeout=10).json()
    assert card["inputs"]["x"]["shape"] == [None, 8]
    example = card["example_request"]
    assert [len(row) for row in example["inputs"]["x"]] == [8, 8]
    r = httpx.post(tiny_server.url + "/v1/pipelines/tiny-diamond/run", json=example, timeout=120)
    assert r.status_code == 200, r.text
    assert {len(row) for row in r.json()["outputs"]["y"]} == {8}
