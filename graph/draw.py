"""Draw a pipeline's DAG: Mermaid or Graphviz DOT text, or PNG through graphviz `dot`.

Nodes are the pipeline's input ports, its stages (name, kind, replicas x devices, batching)
and its output ports; edges are labelled `port -> port`, dashed when streaming.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from omnistage.graph.spec import PIPELINE_INPUTS, PIPELINE_OUTPUTS, EdgeSpec, PipelineSpec


def _node_id(stage: str, port: str) -> str:
    """Mermaid-safe id (names may hold `-`; DOT quotes ids instead)."""
    if stage == PIPELINE_INPUTS:
        raw = f"in_{port}"
    elif stage == PIPELINE_OUTPUTS:
        raw = f"out_{port}"
    else:
        raw = f"s_{stage}"
    return re.sub(r"[^A-Za-z0-9_]", "_", raw)


def _stage_label(spec: PipelineSpec, name: str) -> list[str]:
    stage = spec.stages[name]
    pool = stage.pool
    lines = [name, f"kind: {stage.kind}"]
    lines.append(f"{pool.replicas} x {','.join(pool.devices)} {pool.dtype}")
    lines.append(f"batching: {stage.batching.policy}")
    return lines


def _edge_label(edge: EdgeSpec) -> str:
    label = f"{edge.src.port} → {edge.dst.port}"
    if edge.stream is not None:
        label += f" (stream chunk={edge.stream.chunk}"
        label += f", ctx={edge.stream.left_context})" if edge.stream.left_context else ")"
    return label


def to_mermaid(spec: PipelineSpec) -> str:
    out = ["flowchart LR"]
    for port, type_ in spec.inputs.items():
        out.append(f'    {_node_id(PIPELINE_INPUTS, port)}(["{PIPELINE_INPUTS}.{port}: {type_}"])')
    for name in spec.topo_order() or list(spec.stages):
        out.append(f'    {_node_id(name, "")}["{"<br/>".join(_stage_label(spec, name))}"]')
    for port, type_ in spec.outputs.items():
        out.append(f'    {_node_id(PIPELINE_OUTPUTS, port)}(["{PIPELINE_OUTPUTS}.{port}: {type_}"])')
    for edge in spec.edges:
        arrow = "-.->" if edge.streaming else "-->"
        out.append(
            f'    {_node_id(edge.src.stage, edge.src.port)} {arrow}|"{_edge_label(edge)}"| '
            f"{_node_id(edge.dst.stage, edge.dst.port)}"
        )
    return "\n".join(out) + "\n"


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dot_id(stage: str, port: str) -> str:
    prefix = {PIPELINE_INPUTS: f"in_{port}", PIPELINE_OUTPUTS: f"out_{port}"}
    return _dot_quote(prefix.get(stage, f"s_{stage}"))


def to_dot(spec: PipelineSpec) -> str:
    out = [
        f"digraph {_dot_quote(spec.name)} {{",
        "    rankdir=LR;",
        '    node [fontname="Helvetica", fontsize=10];',
        '    edge [fontname="Helvetica", fontsize=9];',
    ]
    for port, type_ in spec.inputs.items():
        out.append(
            f"    {_dot_quote(f'in_{port}')} [shape=oval, label={_dot_quote(f'{PIPELINE_INPUTS}.{port}: {type_}')}];"
        )
    for name in spec.topo_order() or list(spec.stages):
        label = "\\n".join(line.replace('"', '\\"') for line in _stage_label(spec, name))
        out.append(f'    {_dot_quote(f"s_{name}")} [shape=box, style=rounded, label="{label}"];')
    for port, type_ in spec.outputs.items():
        out.append(
            f"    {_dot_quote(f'out_{port}')} [shape=oval, label={_dot_quote(f'{PIPELINE_OUTPUTS}.{port}: {type_}')}];"
        )
    for edge in spec.edges:
        style = ", style=dashed" if edge.streaming else ""
        out.append(
            f"    {_dot_id(edge.src.stage, edge.src.port)} -> "
            f"{_dot_id(edge.dst.stage, edge.dst.port)} [label={_dot_quote(_edge_label(edge))}{style}];"
        )
    out.append("}")
    return "\n".join(out) + "\n"


def render(spec: PipelineSpec, fmt: str) -> str:
    if fmt == "mermaid":
        return to_mermaid(spec)
    if fmt == "dot":
        return to_dot(spec)
    raise ValueError(f"unknown text format {fmt!r} (mermaid, dot)")


def draw_command(file: str, fmt: str, output: str | None, overrides: list[str] | tuple[str, ...] = ()) -> int:
    """`omnistage graph FILE --format mermaid|dot|png [-o OUT]`; returns the exit code."""
    from omnistage.graph.loader import PipelineValidationError, load_pipeline

    try:
        spec = load_pipeline(file, overrides=list(overrides))
    except PipelineValidationError as err:
        for line in err.problems:
            print(line, file=sys.stderr)
        return 2
    if fmt == "png":
        if not output:
            print("omnistage graph: --format png needs -o FILE.png", file=sys.stderr)
            return 2
        dot = shutil.which("dot")
        if dot is None:
            print(
                "omnistage graph: PNG needs graphviz's `dot` on PATH (apt-get install graphviz); "
                "--format dot or --format mermaid print text without it",
                file=sys.stderr,
            )
            return 1
        result = subprocess.run([dot, "-Tpng", "-o", output], input=to_dot(spec), text=True, capture_output=True)
        if result.returncode != 0:
            print(f"omnistage graph: dot failed: {result.stderr.strip()}", file=sys.stderr)
            return 1
        return 0
    text = render(spec, fmt)
    if output:
        try:
            Path(output).write_text(text, encoding="utf-8")
        except OSError as exc:
            print(f"omnistage graph: cannot write {output}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    else:
        sys.stdout.write(text)
    return 0
