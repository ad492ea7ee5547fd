"""Helpers shared by the reliability tests (`from omnistage.tests.reliability.conftest import ...`)."""

from __future__ import annotations

import time


def one_stage_yaml(factory: str, pool: str = "{}", name: str = "rel", kwargs: str = "{}") -> str:
    """A pipeline of one torch_module stage (x -> y) that gets its request params."""
    return f"""
name: {name}
inputs: {{x: tensor}}
outputs: {{y: tensor}}
stages:
  s:
    kind: torch_module
    params:
      factory: "{factory}"
      kwargs: {kwargs}
      pass_params: true
      inputs: {{x: tensor}}
      outputs: {{y: tensor}}
    batching: {{policy: none}}
    pool: {pool}
edges:
  - {{from: inputs.x, to: s.x}}
  - {{from: s.y, to: outputs.y}}
"""


def wait_for(predicate, timeout: float, what: str, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(every)
