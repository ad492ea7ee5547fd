"""`omnistage serve --set [CONFIG:]PATH=VALUE`: scoped overrides reach only their config."""

import pytest

from omnistage.graph.loader import PipelineValidationError
from omnistage.serving.registry import PipelineRegistry, overrides_per_config


def test_scoped_and_unscoped_overrides_split():
    configs = ["configs/tiny-llm.yaml", "tiny-image", "/x/y/other.yml"]
    split = overrides_per_config(
        configs,
        [
            "stages.a.pool.threads=2",
            "tiny-llm:stages.llm.pool.devices=[cuda:0]",
            "other:limits.max_queued_requests=3",
        ],
    )
    assert split == [
        ["stages.a.pool.threads=2", "stages.llm.pool.devices=[cuda:0]"],
        ["stages.a.pool.threads=2"],
        ["stages.a.pool.threads=2", "limits.max_queued_requests=3"],
    ]
    # a colon inside the value is not a scope
    assert overrides_per_config(["a.yaml"], ["stages.x.pool.devices=cuda:1"]) == [["stages.x.pool.devices=cuda:1"]]
    with pytest.raises(ValueError, match="none of the configs"):
        overrides_per_config(configs, ["nope:stages.x.pool.threads=2"])


def test_registry_applies_scoped_override_through_the_loader(tmp_path):
    from pathlib import Path

    here = Path(__file__).parent / "slow-scale.yaml"
    registry = PipelineRegistry.from_configs([here], ["slow-scale:stages.slow.params.kwargs.delay_s=0.25"])
    (entry,) = registry.entries()
    assert entry.spec.stages["slow"].params["kwargs"]["delay_s"] == 0.25
    assert entry.state == "loading" and entry.pipeline is None  # nothing started yet
    with pytest.raises(PipelineValidationError) as info:
        PipelineRegistry.from_configs([here], ["slow-scale:stages.nosuch.pool.threads=2"])
    assert any("<--set #1>" in line for line in info.value.problems)
