"""A port a stage declares absent (ABSENT / Emission.absent_ports): the stages reached only
through it never see the request (their worker stats count no request), their outputs end
empty, and the rest of the pipeline runs as usual."""

from __future__ import annotations

import pytest
import torch

from omnistage.graph.loader import load_pipeline_text
from omnistage.runtime.pipeline import Pipeline
from omnistage.runtime.testmodules import Dense

DENSE = "{factory: 'omnistage.runtime.testmodules:Dense', inputs: {x: tensor}, outputs: {y: tensor}}"
GRAPH = f"""
name: absent-ports
inputs: {{x: tensor}}
outputs: {{main: tensor, side: tensor}}
stages:
  split:
    kind: torch_module
    params:
      factory: "omnistage.runtime.testmodules:MaybeSide"
      inputs: {{x: tensor}}
      outputs: {{main: tensor, side: tensor}}
      pass_params: true
    batching: {{policy: none}}
  side1: {{kind: torch_module, params: {DENSE}, batching: {{policy: none}}}}
  side2: {{kind: torch_module, params: {DENSE}, batching: {{policy: none}}}}
edges:
  - {{from: inputs.x, to: split.x}}
  - {{from: split.main, to: outputs.main}}
  - {{from: split.side, to: side1.x}}
  - {{from: side1.y, to: side2.x}}
  - {{from: side2.y, to: outputs.side}}
"""


@pytest.fixture(scope="module")
def pipeline():
    with Pipeline.from_spec(load_pipeline_text(GRAPH, "absent.yaml")) as p:
        yield p


def _requests_seen(p, stage: str) -> int:
    return sum(sum(r["outcomes"].values()) for r in p.replica_stats()[stage])


def test_absent_port_skips_the_stages_behind_it(pipeline):
    x = torch.randn(3, 8)
    dense = Dense()
    with torch.no_grad():
        expected_side = dense(dense(x * 2))
    out = pipeline.run({"x": x}, {"split": {"side": True}}, timeout=60)
    torch.testing.assert_close(out["main"], x + 1)
    torch.testing.assert_close(out["side"], expected_side)
    seen = {s: _requests_seen(pipeline, s) for s in ("split", "side1", "side2")}
    assert seen == {"split": 1, "side1": 1, "side2": 1}

    out = pipeline.run({"x": x}, {"split": {"side": False}}, timeout=60)
    torch.testing.assert_close(out["main"], x + 1)
    assert out["side"] is None
    assert {s: _requests_seen(pipeline, s) for s in ("split", "side1", "side2")} == {"split": 2, "side1": 1, "side2": 1}
