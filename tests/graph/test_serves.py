"""The `serves:` section: shipped pipelines declare their API families, mistakes are reported
at file:line:col, and the JSON Schema agrees with validation on what it accepts."""

from __future__ import annotations

import jsonschema
import pytest
from ruamel.yaml import YAML

from omnistage.graph.loader import PipelineValidationError, load_pipeline, load_pipeline_text
from omnistage.graph.schema import json_schema

LLM = load_pipeline("tiny-llm").source.read_text()
GOOD = "  chat: {messages: messages, text: text, info: info, params: [llm]}\n"


def _with_serves(block: str) -> str:
    head, _, rest = LLM.partition("serves:\n")
    tail = rest[rest.index("stages:") :]
    return f"{head}serves:\n{block}{tail}"


def test_shipped_pipelines_declare_their_families():
    llm, image = load_pipeline("tiny-llm"), load_pipeline("tiny-image")
    assert set(llm.serves) == {"chat", "completions"}
    assert llm.serves["chat"].ports == {"messages": "messages", "text": "text", "info": "info"}
    assert llm.serves["chat"].params == ["llm"]
    assert set(image.serves) == {"images"}
    assert image.serves["images"].params == ["text_encoder", "denoiser", "vae"]
    assert image.serves["images"].modalities == {"input": ["text", "image"], "output": ["image"]}


@pytest.mark.parametrize(
    ("block", "line_col", "needle"),
    [
        ("  chatt: {messages: messages, text: text}\n", "3", "unknown API family 'chatt' (did you mean 'chat'?)"),
        ("  chat: {messages: messages, txt: text}\n", "3", "unknown key 'txt' in serves.chat (did you mean 'text'?)"),
        ("  chat: {messages: messages}\n", "3", "serves.chat: missing required field 'text'"),
        ("  chat: {messages: messages, text: tokens}\n", "3", "port 'tokens' is tokens, the role needs text"),
        ("  chat: {messages: msgs, text: text}\n", "3", "'msgs' is not a pipeline input port"),
        ("  chat: {messages: messages, text: text, params: [lm]}\n", "3", "'lm' is not a stage of this pipeline"),
        ("  chat: [messages]\n", "9", "serves.chat must be a mapping"),
    ],
)
def test_mistakes_point_at_the_file(block, line_col, needle):
    text = _with_serves(block)
    line = text.splitlines().index(block.rstrip("\n")) + 1
    with pytest.raises(PipelineValidationError) as info:
        load_pipeline_text(text, "p.yaml")
    hits = [p for p in info.value.problems if needle in p]
    assert hits, info.value.problems
    assert hits[0].startswith(f"p.yaml:{line}:"), hits


def test_schema_agrees_with_validation():
    validator = jsonschema.Draft202012Validator(json_schema())
    good = YAML(typ="safe").load(_with_serves(GOOD))
    assert not list(validator.iter_errors(good))
    for bad in ("  chatt: {messages: messages, text: text}\n", "  chat: {messages: messages}\n"):
        doc = YAML(typ="safe").load(_with_serves(bad))
        assert list(validator.iter_errors(doc)), bad
