"""Turn a pipeline's node tree into a PipelineSpec, reporting every problem on the way."""

from __future__ import annotations

import re
from pathlib import Path

from omnistage.graph import fields as F
from omnistage.graph.checks import Report, did_you_mean
from omnistage.graph.inputs import TensorSpec, parse_port
from omnistage.graph.nodes import MapNode, Node, Problem, ScalarNode, broken_positions, describe
from omnistage.graph.serves import check_serves
from omnistage.graph.spec import PipelineSpec, SourcePos
from omnistage.graph.stages_check import StageInfo, check_stage
from omnistage.graph.wiring import PipelinePorts, check_edges, check_wiring
from omnistage.stages.contracts import PORT_TYPES


def build_spec(root: Node, file: str, source: Path | None, problems: list[Problem]) -> PipelineSpec | None:
    """The validated spec, or None when any problem was found (all appended to `problems`)."""
    report = Report(problems)
    report.muted = broken_positions(root)
    top = SourcePos(file, 1, 1)
    if not isinstance(root, MapNode):
        report.add(
            root.pos, f"a pipeline file must be a mapping (name, inputs, outputs, stages, edges), got {describe(root)}"
        )
        return None
    report.keys(root, F.PIPELINE, "the pipeline", top)
    values = report.fields(root, F.PIPELINE, "")
    name = values.get("name", "")
    description = values.get("description") or ""

    input_tensors: dict[str, TensorSpec] = {}
    inputs, _ = _ports(root, "inputs", report, input_tensors)
    outputs, output_pos = _ports(root, "outputs", report)
    ports = PipelinePorts(inputs, outputs, output_pos)

    max_queued, deadline = 256, None
    limits = report.mapping(root.get("limits"), "limits", top)
    if limits is not None:
        report.keys(limits, F.LIMITS, "limits", limits.pos)
        lv = report.fields(limits, F.LIMITS, "limits")
        max_queued = lv.get("max_queued_requests", max_queued)
        deadline = lv.get("deadline_s", deadline)

    base_dir = source.parent if source is not None else None
    stages: dict[str, StageInfo] = {}
    stages_node = report.mapping(root.get("stages"), "stages", top)
    if stages_node is not None:
        if not stages_node.entries:
            report.add(stages_node.pos, "stages is empty; a pipeline needs at least one stage")
        for stage_name, node in stages_node.entries.items():
            stages[stage_name] = check_stage(stage_name, stages_node.key_pos[stage_name], node, report, base_dir)

    edges = check_edges(root.get("edges"), report) if root.get("edges") is not None else []
    outputs_at = root.key_pos.get("outputs", top)
    check_wiring(stages, ports, edges, report, outputs_at)
    serves = {}
    if root.get("serves") is not None:
        serves = check_serves(root.get("serves"), inputs or {}, outputs or {}, set(stages), report)

    if report:
        return None
    return PipelineSpec(
        name=name,
        description=description,
        inputs=inputs or {},
        outputs=outputs or {},
        stages={n: info.spec for n, info in stages.items()},
        edges=[e.spec for e in edges],
        source=source,
        max_queued_requests=max_queued,
        default_deadline_s=deadline,
        input_tensors=input_tensors,
        serves=serves,
    )


def _ports(
    root: MapNode, section: str, report: Report, tensors: dict[str, TensorSpec] | None = None
) -> tuple[dict[str, str] | None, dict]:
    """{port: type} of `inputs` / `outputs`; None when the section is unusable. With
    `tensors`, ports may be written {type, shape, dtype} (graph/inputs.py) and their
    declarations are collected there."""
    node = root.get(section)
    if node is None:
        return {}, {}
    m = report.mapping(node, section, node.pos)
    if m is None:
        return None, {}
    if section == "outputs" and not m.entries:  # as the schema says: a pipeline answers something
        report.add(node.pos, "outputs: a pipeline needs at least one output port {port: type}")
        return None, {}
    ports: dict[str, str] = {}
    positions: dict[str, SourcePos] = {}
    ok = True
    for port, type_node in m.entries.items():
        key_pos = m.key_pos[port]
        positions[port] = key_pos
        if not re.match(F.NAME_PATTERN, port):
            report.add(
                key_pos,
                f"{section}: port name {port!r} is not valid (letters, digits, _ and -, starting with a letter or _)",
            )
            ok = False
            continue
        if tensors is not None and isinstance(type_node, MapNode):
            parsed = parse_port(type_node, f"{section}.{port}", report, PORT_TYPES)
            if parsed is None:
                ok = False
            else:
                ports[port], tensors[port] = parsed
            continue
        if not (isinstance(type_node, ScalarNode) and isinstance(type_node.value, str)):
            report.add(
                type_node.pos,
                f"{section}.{port} must be a port type ({', '.join(PORT_TYPES)}), got {describe(type_node)}",
            )
            ok = False
            continue
        if type_node.value not in PORT_TYPES:
            report.add(
                type_node.pos,
                f"{section}.{port}: unknown port type {type_node.value!r}"
                f"{did_you_mean(type_node.value, PORT_TYPES)}; types: "
                f"{', '.join(PORT_TYPES)}",
            )
            ok = False
            continue
        ports[port] = type_node.value
    return (ports if ok else None), positions
