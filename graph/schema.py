"""JSON Schema (draft 2020-12) of the pipeline YAML format, built from graph/fields.py.

For editors (yaml-language-server: `# yaml-language-server: $schema=pipeline.schema.json`).
It describes shapes only; wiring (ports, types, cycles) is checked by `omnistage validate`.
`${VAR}` references are allowed wherever a number or list is expected, because the editor
sees the file before interpolation.
"""

from __future__ import annotations

from typing import Any

from omnistage.graph import fields as F
from omnistage.graph.inputs import TENSOR_DTYPES
from omnistage.graph.serves import json_schema as serves_schema
from omnistage.stages.contracts import PORT_TYPES

_ENV_REF = {
    "type": "string",
    "pattern": r"\$\{[^}]+\}",
    "description": "holds an ${VAR:-default} reference, checked after interpolation",
}


def _field(field: F.Field) -> dict[str, Any]:
    out: dict[str, Any] = {"description": field.doc}
    if field.type in ("string", "integer", "number", "boolean"):
        types = [field.type] + (["null"] if field.nullable else [])
        out["type"] = types[0] if len(types) == 1 else types
    if field.enum is not None:
        out["enum"] = list(field.enum) + ([None] if field.nullable else [])
    if field.pattern is not None:
        out["pattern"] = field.pattern
    if field.minimum is not None:
        out["minimum"] = field.minimum
    if field.exclusive_minimum is not None:
        out["exclusiveMinimum"] = field.exclusive_minimum
    if field.type in ("integer", "number", "boolean") or field.enum or field.pattern:
        # Before interpolation a number may still be written as ${VAR:-4}.
        described = {k: v for k, v in out.items() if k != "description"}
        return {"description": field.doc, "anyOf": [described, _ENV_REF]}
    return out


def _object(fields: dict[str, F.Field], overrides: dict[str, Any]) -> dict[str, Any]:
    props = {k: overrides.get(k) or _field(f) for k, f in fields.items()}
    required = [k for k, f in fields.items() if f.required]
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    return out


def _batching() -> dict[str, Any]:
    variants = []
    for policy, knobs in F.BATCHING_KNOBS.items():
        variant = _object(knobs, {})
        variant["properties"]["policy"] = {"const": policy}
        variant["required"] = ["policy"]
        variant["description"] = f"{policy} batching"
        variants.append(variant)
    return {
        "description": F.STAGE["batching"].doc,
        "anyOf": [
            {"type": "string", "enum": list(F.BATCHING_KNOBS)},
            # policy omitted: the kind's default policy; its knobs are checked at load
            {
                "type": "object",
                "not": {"required": ["policy"]},
                "propertyNames": {"enum": sorted({k for v in F.BATCHING_KNOBS.values() for k in v})},
            },
            *variants,
        ],
    }


def _tensor_port() -> dict[str, Any]:
    """An input declared with its shape/dtype (graph/inputs.py)."""
    return {
        "type": "object",
        "required": ["type"],
        "additionalProperties": False,
        "properties": {
            "type": {"enum": list(PORT_TYPES)},
            "shape": {"type": "array", "items": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]}},
            "dtype": {"enum": list(TENSOR_DTYPES)},
        },
    }


def _pool() -> dict[str, Any]:
    device = {"type": "string", "pattern": F.DEVICE_PATTERN}
    return _object(
        F.POOL,
        {
            "devices": {
                "description": F.POOL["devices"].doc,
                "anyOf": [
                    {"type": "array", "items": {"anyOf": [device, _ENV_REF]}, "minItems": 1},
                    {
                        "type": "string",
                        "pattern": r"^\s*(cpu|cuda(:[0-9]+)?)(\s*,\s*(cpu|cuda(:[0-9]+)?))*\s*$",
                    },
                    _ENV_REF,
                ],
            },
            **{
                key: {
                    "description": F.POOL[key].doc,
                    "anyOf": [
                        {"type": "string", "pattern": F.MEMORY_PATTERN},
                        {"type": "integer", "minimum": 1},
                        _ENV_REF,
                    ],
                }
                for key in ("memory", "max_rss")
            },
            "cpus": {
                "description": F.POOL["cpus"].doc,
                "anyOf": [
                    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                    {"type": "integer", "minimum": 0},
                    {"type": "string", "pattern": r"^\s*[0-9]+(-[0-9]+)?(\s*,\s*[0-9]+(-[0-9]+)?)*\s*$"},
                    _ENV_REF,
                ],
            },
            "autoscaling": _object(F.AUTOSCALING, {}),
            "resources": {
                "description": F.POOL["resources"].doc,
                "type": "object",
                "additionalProperties": {"type": "number", "minimum": 0},
            },
        },
    )


def _stage() -> dict[str, Any]:
    model_map = _object(F.MODEL, {})
    return _object(
        F.STAGE,
        {
            "model": {"description": F.STAGE["model"].doc, "anyOf": [{"type": "string", "minLength": 1}, model_map]},
            "pool": _pool(),
            "batching": _batching(),
            "params": {"type": ["object", "null"], "description": F.STAGE["params"].doc},
            "request_defaults": {"type": ["object", "null"], "description": F.STAGE["request_defaults"].doc},
        },
    )


def _edge() -> dict[str, Any]:
    endpoint = {"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_-]*\.[A-Za-z_][A-Za-z0-9_-]*$"}
    return _object(
        F.EDGE,
        {
            "from": {**endpoint, "description": F.EDGE["from"].doc},
            "to": {**endpoint, "description": F.EDGE["to"].doc},
            "stream": {
                "description": F.EDGE["stream"].doc,
                "anyOf": [{"type": ["boolean", "null"]}, _object(F.STREAM, {})],
            },
        },
    )


def _pipeline() -> dict[str, Any]:
    port_map = {
        "type": "object",
        "propertyNames": {"pattern": F.NAME_PATTERN},
        "additionalProperties": {"enum": list(PORT_TYPES)},
    }
    return _object(
        F.PIPELINE,
        {
            "inputs": {
                **port_map,
                "additionalProperties": {"anyOf": [port_map["additionalProperties"], _tensor_port()]},
                "description": F.PIPELINE["inputs"].doc,
            },
            "outputs": {**port_map, "description": F.PIPELINE["outputs"].doc, "minProperties": 1},
            "stages": {
                "type": "object",
                "description": F.PIPELINE["stages"].doc,
                "minProperties": 1,
                "propertyNames": {"pattern": F.NAME_PATTERN, "not": {"enum": ["inputs", "outputs"]}},
                "additionalProperties": {"$ref": "#/$defs/stage"},
            },
            "edges": {"type": "array", "description": F.PIPELINE["edges"].doc, "items": {"$ref": "#/$defs/edge"}},
            "limits": _object(F.LIMITS, {}),
            "serves": serves_schema(),
        },
    )


def json_schema() -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://omnistage.dev/schemas/pipeline.json",
        "title": "omnistage pipeline",
        "description": "A multi-stage pipeline: typed input/output ports, stages, and the edges "
        "between them. See docs/pipelines.md.",
        **_pipeline(),
        "$defs": {"stage": _stage(), "edge": _edge()},
    }
