"""Fixtures for the ar_lm stage tests: the tiny-llm checkpoint and transformers' tokenizer."""

import pytest

from omnistage.models.recipes import build_recipe


@pytest.fixture(scope="session")
def tiny_llm_dir():
    return build_recipe("tiny-llm")


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_llm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llm_dir)


@pytest.fixture(scope="session")
def text_tokenizer(tiny_llm_dir):
    from omnistage.stages.ar.text import TextTokenizer

    return TextTokenizer.from_pretrained(tiny_llm_dir)
