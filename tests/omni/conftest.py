"""Tiny Qwen2.5-Omni checkpoints (the `tiny:` recipes) and transformers' reference model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def omni_dir():
    from omnistage.models.recipes import resolve_model

    return resolve_model("tiny:qwen2_5_omni")


@pytest.fixture(scope="session")
def omni_gqa_dir():
    from omnistage.models.recipes import resolve_model

    return resolve_model("tiny:qwen2_5_omni-gqa")


def load_reference(path):
    """transformers' full model (thinker, talker, token2wav, voices from spk_dict.pt)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(str(path)).eval()


@pytest.fixture(scope="session")
def omni_ref(omni_dir):
    return load_reference(omni_dir)


@pytest.fixture(scope="session")
def omni_gqa_ref(omni_gqa_dir):
    return load_reference(omni_gqa_dir)


def reference_processor(path):
    """transformers' Qwen2_5OmniProcessor with its PIL image processor; its torchvision-only
    video processor check is skipped (the text, audio and image paths never use it)."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

    class WithoutVideo(Qwen2_5OmniProcessor):
        def check_argument_for_proper_class(self, name, arg):
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(path))
    return WithoutVideo(
        image_processor=Qwen2VLImageProcessorPil(),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(str(path)),
        tokenizer=tok,
    )


def make_ctx(kind, model_dir, params=None, **batching):
    """A StageContext for building one stage engine in the test process (CPU, float32)."""
    import torch

    from omnistage.graph.spec import BatchingSpec
    from omnistage.stages.base import StageContext

    policy = "continuous" if kind in ("thinker", "talker") else "dynamic"
    return StageContext(
        stage_name=kind,
        kind=kind,
        model_path=str(model_dir),
        model_subfolder=None,
        model_prefix=None,
        device=torch.device("cpu"),
        dtype=torch.float32,
        batching=BatchingSpec(**{"policy": policy, "max_wait_ms": 0.0, **batching}),
        params=dict(params or {}),
    )


def run_stage(stage, max_steps: int = 10000) -> dict:
    """Step until idle: {request_id: [emissions]}."""
    out: dict = {}
    steps = 0
    while stage.has_work():
        for e in stage.step():
            out.setdefault(e.request_id, []).append(e)
        steps += 1
        assert steps < max_steps, "stage did not finish"
    return out
