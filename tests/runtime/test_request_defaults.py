"""A stage's YAML `request_defaults`: checked at load against the kind's request parameters
(errors at FILE:LINE:COL), and given to each request that does not send its own values."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.graph.loader import PipelineValidationError, load_pipeline
from omnistage.runtime.pipeline import Pipeline

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-llm.yaml"
DEFAULTS = "    request_defaults: {max_tokens: 7, ignore_eos: true, temperature: 0}\n"


def _with_defaults(tmp_path: Path, defaults: str) -> Path:
    text = CONFIG.read_text()
    anchor = "    kind: ar_lm\n"
    assert anchor in text
    path = tmp_path / "tiny-llm-defaults.yaml"
    path.write_text(text.replace(anchor, anchor + defaults))
    return path


def _line_col(path: Path, needle: str) -> tuple[int, int]:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if needle in line:
            return number, line.index(needle) + 1
    raise AssertionError(needle)


def test_unknown_and_bad_defaults_are_reported_where_they_are(tmp_path):
    path = _with_defaults(tmp_path, "    request_defaults: {max_tokns: 7, temperature: -1}\n")
    with pytest.raises(PipelineValidationError) as err:
        load_pipeline(str(path))
    text = str(err.value)
    line, col = _line_col(path, "max_tokns")
    assert f"{path}:{line}:{col}: stages.llm.request_defaults: unknown ar_lm request parameter 'max_tokns'" in text
    assert "did you mean 'max_tokens'?" in text
    line, col = _line_col(path, "-1")
    assert f"{path}:{line}:{col}: stages.llm.request_defaults: temperature" in text


def test_a_request_gets_the_defaults_under_its_own_values(tmp_path):
    spec = load_pipeline(str(_with_defaults(tmp_path, DEFAULTS)))
    assert spec.stages["llm"].request_defaults == {"max_tokens": 7, "ignore_eos": True, "temperature": 0}
    prompt = {"prompt": "The cache"}
    with Pipeline.from_spec(spec) as pipeline:
        defaulted = pipeline.run(prompt)
        explicit = pipeline.run(prompt, {"llm": {"max_tokens": 7, "ignore_eos": True, "temperature": 0}})
        shorter = pipeline.run(prompt, {"llm": {"max_tokens": 3}})
    # the defaults are exactly what a request sending those values gets
    assert defaulted["tokens"] == explicit["tokens"] and len(defaulted["tokens"]) == 7
    # a request's own value wins; the defaults it did not override still hold (greedy: a prefix)
    assert shorter["tokens"] == explicit["tokens"][:3]
