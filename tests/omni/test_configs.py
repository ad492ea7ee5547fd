"""The omni pipeline files validate (without building a model) and place the stages as stated."""

from __future__ import annotations

import pytest

from omnistage.graph.loader import load_pipeline


def test_real_checkpoint_config_validates_with_a_two_gpu_placement():
    spec = load_pipeline("qwen2_5_omni", environ={"OMNI_MODEL": "/models/Qwen2.5-Omni-7B"})
    devices = {name: stage.pool.devices for name, stage in spec.stages.items()}
    assert devices == {
        "audio_encoder": ["cuda:0"],
        "vision_encoder": ["cuda:0"],
        "thinker": ["cuda:0"],
        "talker": ["cuda:1"],
        "token2wav": ["cuda:1"],
    }
    assert spec.stages["thinker"].model.source == "/models/Qwen2.5-Omni-7B"
    moved = load_pipeline("qwen2_5_omni", environ={"OMNI_THINKER_DEVICE": "cuda:2", "OMNI_SPEECH_DEVICE": "cuda:3"})
    assert moved.stages["thinker"].pool.devices == ["cuda:2"] and moved.stages["token2wav"].pool.devices == ["cuda:3"]


def test_tiny_config_validates_and_a_bad_param_points_at_its_line():
    spec = load_pipeline("tiny-omni")
    assert [e for e in spec.edges if e.stream is not None and e.src.stage == "thinker" and e.dst.stage == "talker"]
    with pytest.raises(Exception) as err:
        load_pipeline("tiny-omni", ["stages.talker.params.generate_compat=maybe"])
    # at the bad value, which is in the override
    assert str(err.value).startswith("<--set #1>:1:38: stages.talker.params: generate_compat must be a boolean")
