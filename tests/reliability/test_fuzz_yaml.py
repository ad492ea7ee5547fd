"""Hypothesis against the pipeline loader: mutations of valid pipeline files (any node
replaced, removed or joined by a stray key, any scalar turned into any other value) and
arbitrary text. Every outcome is a spec or a PipelineValidationError whose every line points
at `FILE:LINE:COL`; no other exception, no hang (each example is bounded by hypothesis's
deadline)."""

from __future__ import annotations

import copy
import json
import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnistage.graph.loader import PipelineValidationError, load_pipeline_text

BASE = {
    "name": "fuzz",
    "inputs": {"x": "tensor", "prompt": {"type": "text"}},
    "outputs": {"y": "tensor"},
    "limits": {"max_queued_requests": 8, "deadline_s": 30},
    "stages": {
        "a": {
            "kind": "torch_module",
            "params": {
                "factory": "omnistage.runtime.testmodules:Dense",
                "inputs": {"x": "tensor"},
                "outputs": {"y": "tensor"},
            },
            "batching": {"policy": "dynamic", "max_batch_size": 4, "max_wait_ms": 1},
            "pool": {"devices": "cpu", "replicas": 1, "threads": 1, "step_timeout_s": 30, "max_rss": "1GiB"},
        },
        "b": {"kind": "noop", "params": {"inputs": {"x": "tensor"}, "outputs": {"y": "tensor"}}},
    },
    "edges": [
        {"from": "inputs.x", "to": "a.x"},
        {"from": "a.y", "to": "b.x", "max_inflight": 2},
        {"from": "b.y", "to": "outputs.y"},
    ],
}
LINE = re.compile(r"^fuzz\.yaml:\d+:\d+: \S")

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["cuda:7", "tiny:none", "${HOME}", "${X:-1}", "1e999", "0", "-1", "GiB", "a.b", "inputs.x"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, (*prefix, i))


ALL_PATHS = [p for p in paths(BASE) if p]


@st.composite
def mutated(draw):
    doc = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(ALL_PATHS))
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            action = draw(st.sampled_from(["replace", "delete", "stray"]))
            if action == "replace":
                parent[path[-1]] = draw(values)
            elif action == "delete":
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[draw(st.text(min_size=1, max_size=10))] = draw(values)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation removed or replaced this path
    return doc


def check(text: str) -> None:
    try:
        load_pipeline_text(text, "fuzz.yaml", environ={})
    except PipelineValidationError as exc:
        assert exc.problems
        for line in exc.problems:
            assert LINE.match(line), line


FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow], database=None)


def test_the_base_document_is_valid():
    load_pipeline_text(json.dumps(BASE), "fuzz.yaml", environ={})


@FUZZ
@given(mutated())
def test_mutated_pipelines_load_or_fail_with_positions(doc):
    check(json.dumps(doc, allow_nan=True))


@FUZZ
@given(st.text(max_size=300))
def test_arbitrary_text_loads_or_fails_with_positions(text):
    check(text)
