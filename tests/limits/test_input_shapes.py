"""Pipeline inputs declared with a shape/dtype (graph/inputs.py) are checked at admission:
a wrong input is refused with an InvalidRequestError naming `inputs.PORT` (HTTP 400 from a
live server, read with httpx) before any stage runs, instead of failing inside a stage."""

from __future__ import annotations

import textwrap

import httpx
import numpy as np
import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.graph.loader import PipelineValidationError, load_pipeline
from omnistage.runtime.pipeline import Pipeline

PIPELINE = """
name: shaped
inputs:
  x: {type: tensor, shape: [null, 8], dtype: float32}
  note: text
outputs: {y: tensor}
stages:
  copy:
    kind: noop
    params: {inputs: {x: tensor}}
edges:
  - {from: inputs.x, to: copy.x}
  - {from: copy.x, to: outputs.y}
"""


def _write(tmp_path, text: str):
    path = tmp_path / "p.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_declaration_is_parsed(tmp_path):
    spec = load_pipeline(str(_write(tmp_path, PIPELINE)))
    assert spec.inputs == {"x": "tensor", "note": "text"}
    assert spec.input_tensors["x"].shape == (None, 8)
    assert spec.input_tensors["x"].dtype == "float32"
    assert "note" not in spec.input_tensors


@pytest.mark.parametrize(
    "port, at, message",
    [
        ("{type: tensor, shape: [null, -8]}", "-8", "each size must be an integer >= 0 or null"),
        ("{type: tensor, dtype: float33}", "float33", "dtype must be one of"),
        ("{type: tensr, shape: [2]}", "tensr", "x.type must be a port type"),
        ("{type: tensor, shap: [2]}", "shap", "unknown key 'shap'"),
        ("{type: tensor, shape: 8}", "8}", "shape must be a list"),
    ],
)
def test_bad_declarations_point_at_the_value(tmp_path, port, at, message):
    text = textwrap.dedent(PIPELINE.replace("{type: tensor, shape: [null, 8], dtype: float32}", port))
    path = _write(tmp_path, text)
    line_no, line = next((i, ln) for i, ln in enumerate(text.splitlines(), 1) if port in ln)
    with pytest.raises(PipelineValidationError) as info:
        load_pipeline(str(path))
    report = str(info.value)
    assert f"{path}:{line_no}:{line.index(at, line.index(port)) + 1}: " in report, report
    assert message in report, report


@pytest.fixture(scope="module")
def diamond():
    with Pipeline.from_yaml("tiny-diamond") as p:
        yield p


@pytest.mark.parametrize(
    "value, problem",
    [
        (torch.ones(3), "must have shape [*, 8], got shape [3]"),
        (torch.ones(4, 7), "must have shape [*, 8], got shape [4, 7]"),
        (torch.ones(0, 8), "must not be empty, got shape [0, 8]"),
        (torch.ones(4, 8, dtype=torch.float64), "must have dtype float32, got float64"),
        ([[1.0] * 8], "must be a tensor [*, 8] float32, got list"),
        (np.zeros((3, 8), np.float32), "must be a torch tensor [*, 8] float32, got a numpy array"),
    ],
)
def test_wrong_input_is_refused_at_admission(diamond, value, problem):
    before = diamond.request_counts
    with pytest.raises(InvalidRequestError) as info:
        diamond.run({"x": value}, timeout=30)
    assert info.value.param == "inputs.x"
    assert problem in str(info.value)
    # refused before admission: no stage held it, so no outcome (ok, invalid, ...) was counted
    assert not str(info.value).startswith("stage ")
    assert diamond.request_counts == before
    x = torch.randn(5, 8)
    assert diamond.run({"x": x}, timeout=30)["h"].shape == (5, 8)  # the producer ran it


def test_http_wrong_shape_is_a_400_naming_the_input(tiny_server):
    url = f"{tiny_server.url}/v1/pipelines/tiny-diamond/run"
    bad = httpx.post(url, json={"inputs": {"x": [1, 2, 3]}}, timeout=30)
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["param"] == "inputs.x"
    assert "shape [*, 8]" in error["message"]
    good = httpx.post(url, json={"inputs": {"x": [[0.5] * 8] * 3}}, timeout=30)
    assert good.status_code == 200, good.text
    card = httpx.get(f"{tiny_server.url}/v1/pipelines/tiny-diamond", timeout=30).json()
    assert card["inputs"]["x"] == {"type": "tensor", "shape": [None, 8], "dtype": "float32"}
