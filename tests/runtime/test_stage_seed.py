"""A module a factory initialises at random gets the same weights in every replica and every
process: the worker seeds torch from the stage's name before building it (a newcomer saw two
Ray replicas of an unseeded torch.nn:Linear answer differently, and the embedded runtime a
third way)."""

from __future__ import annotations

import torch

from omnistage.graph.loader import load_pipeline
from omnistage.runtime.worker import WorkerConfig, build_engine

YAML = """
name: mlp
inputs: {x: tensor}
outputs: {y: tensor, z: tensor}
stages:
  a: {kind: torch_module, pool: {replicas: 2}, params: {factory: 'torch.nn:Linear', kwargs: {in_features: 4, out_features: 3}}}
  b: {kind: torch_module, params: {factory: 'torch.nn:Linear', kwargs: {in_features: 4, out_features: 3}}}
edges: [{from: inputs.x, to: a.x}, {from: inputs.x, to: b.x}, {from: a.y, to: outputs.y}, {from: b.y, to: outputs.z}]
"""


def test_random_weights_depend_on_the_stage_not_the_process(tmp_path):
    path = tmp_path / "mlp.yaml"
    path.write_text(YAML)
    spec = load_pipeline(str(path))

    def weight(stage: str, replica: int) -> torch.Tensor:
        torch.rand(int(torch.randint(1, 100, ())))  # whatever the process drew before
        return build_engine(WorkerConfig(spec, stage, replica, "cpu", "test")).module.weight.detach().clone()

    with torch.random.fork_rng():
        first = weight("a", 0)
        after_first = torch.rand(4)
        assert torch.equal(weight("a", 0), first)  # the same replica again (a restart)
        # what it draws afterwards (an unseeded request's sampling) differs from the last start
        assert not torch.equal(torch.rand(4), after_first)
        assert torch.equal(weight("a", 1), first)  # another replica
        assert not torch.equal(weight("b", 0), first)  # another stage: its own draw
