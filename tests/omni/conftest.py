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
