"""Validate `edges:` and the graph they make: endpoints, port types, streaming, producers per
input, unconnected inputs, cycles."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.graph import fields as F
from omnistage.graph.checks import Report, did_you_mean
from omnistage.graph.nodes import Node, ScalarNode
from omnistage.graph.spec import (
    PIPELINE_INPUTS,
    PIPELINE_OUTPUTS,
    EdgeSpec,
    Endpoint,
    SourcePos,
    StreamSpec,
)
from omnistage.graph.stages_check import StageInfo


@dataclass
class EdgeInfo:
    spec: EdgeSpec
    src_node: ScalarNode
    dst_node: ScalarNode
    stream_pos: SourcePos | None


@dataclass
class PipelinePorts:
    inputs: dict[str, str] | None  # None: the section was broken, skip checks against it
    outputs: dict[str, str] | None
    output_pos: dict[str, SourcePos]


def check_edges(node: Node, report: Report) -> list[EdgeInfo]:
    seq = report.seq(node, "edges")
    if seq is None:
        return []
    edges = []
    for index, item in enumerate(seq.items):
        where = f"edges[{index}]"
        m = report.mapping(item, where, item.pos)
        if m is None:
            continue
        report.keys(m, F.EDGE, where, m.pos)
        values = report.fields(m, F.EDGE, where)
        src = _endpoint(m.get("from"), values.get("from"), f"{where}.from", report)
        dst = _endpoint(m.get("to"), values.get("to"), f"{where}.to", report)
        stream = _stream(m.get("stream"), f"{where}.stream", report)
        if src is None or dst is None:
            continue
        spec = EdgeSpec(src=src, dst=dst, stream=stream, max_inflight=values.get("max_inflight"), pos=m.pos)
        edges.append(EdgeInfo(spec, m.get("from"), m.get("to"), m.key_pos.get("stream")))
    return edges


def _endpoint(node: Node | None, value: str | None, where: str, report: Report) -> Endpoint | None:
    if node is None or value is None:
        return None
    stage, dot, port = value.partition(".")
    if not dot or not stage or not port:
        report.add(node.pos, f"{where}: {value!r} is not stage.port (e.g. llm.text, inputs.prompt, outputs.audio)")
        return None
    endpoint = Endpoint(stage.strip(), port.strip())
    if where.endswith(".from") and endpoint.stage == PIPELINE_OUTPUTS:
        report.add(
            node.pos, f"an edge cannot start at {endpoint}: pipeline outputs are sinks (write it as `to: {endpoint}`)"
        )
        return None
    if where.endswith(".to") and endpoint.stage == PIPELINE_INPUTS:
        report.add(
            node.pos, f"an edge cannot end at {endpoint}: pipeline inputs are sources (write it as `from: {endpoint}`)"
        )
        return None
    return endpoint


def _stream(node: Node | None, where: str, report: Report) -> StreamSpec | None:
    """StreamSpec or None (not streaming); a broken one is reported and read as the default."""
    if node is None:
        return None
    if isinstance(node, ScalarNode) and (node.value is None or isinstance(node.value, bool)):
        return StreamSpec() if node.value else None
    m = report.mapping(node, where, node.pos)
    if m is None:
        return StreamSpec()  # reported; keep the edge so its endpoints are still checked
    report.keys(m, F.STREAM, where, m.pos)
    return StreamSpec(**report.fields(m, F.STREAM, where))


def check_wiring(
    stages: dict[str, StageInfo], ports: PipelinePorts, edges: list[EdgeInfo], report: Report, outputs_at: SourcePos
) -> None:
    producers: dict[Endpoint, EdgeInfo] = {}
    for edge in edges:
        src_type = _source_type(edge, stages, ports, report)
        dst = _dest(edge, stages, ports, report)
        if dst is None:
            continue
        dst_type, dst_streams = dst
        first = producers.get(edge.spec.dst)
        if first is not None:
            report.add(
                edge.dst_node.pos,
                f"{edge.spec.dst} already has a producer "
                f"({first.spec.src} at {first.dst_node.pos}); one producer "
                "per input port (fan-in goes to different ports)",
            )
        else:
            producers[edge.spec.dst] = edge
        if src_type is not None and dst_type is not None and not _compatible(src_type, dst_type):
            report.add(
                edge.dst_node.pos, f"type mismatch: {edge.spec.src} is {src_type} but {edge.spec.dst} takes {dst_type}"
            )
        if edge.spec.streaming and dst_streams is False:
            report.add(
                edge.stream_pos or edge.spec.pos,
                f"streaming edge into {edge.spec.dst}, which does not accept chunks "
                "(its port is not streaming); drop `stream:` or connect a streaming port",
            )

    for name, info in stages.items():
        if info.inputs is None:
            continue
        for port_name, port in info.inputs.items():
            if not port.optional and Endpoint(name, port_name) not in producers:
                report.add(
                    info.key_pos,
                    f"input port {port_name!r} ({port.type}) of stage "
                    f"{name!r} is not connected; add an edge "
                    f"`to: {name}.{port_name}`",
                )
    if ports.outputs is not None:
        for port_name in ports.outputs:
            if Endpoint(PIPELINE_OUTPUTS, port_name) not in producers:
                report.add(
                    ports.output_pos.get(port_name, outputs_at),
                    f"pipeline output {port_name!r} is not connected; add an edge `to: outputs.{port_name}`",
                )
    _check_cycles(stages, edges, report)


def _compatible(a: str, b: str) -> bool:
    return a == b or a == "any" or b == "any"


def _port_pos(edge_node: ScalarNode, endpoint: Endpoint) -> SourcePos:
    if not isinstance(edge_node.value, str) or "." not in edge_node.value:
        return edge_node.pos
    return edge_node.sub_pos(edge_node.value.index(".") + 1)


def _source_type(edge: EdgeInfo, stages, ports: PipelinePorts, report: Report) -> str | None:
    src, node = edge.spec.src, edge.src_node
    if src.stage == PIPELINE_INPUTS:
        if ports.inputs is None:
            return None
        if src.port not in ports.inputs:
            report.add(
                _port_pos(node, src),
                f"the pipeline has no input {src.port!r}"
                f"{did_you_mean(src.port, ports.inputs)}; inputs: "
                f"{', '.join(ports.inputs) or 'none'}",
            )
            return None
        return ports.inputs[src.port]
    info = _stage(src.stage, node, stages, report, "source")
    if info is None or info.outputs is None:
        return None
    port = info.outputs.get(src.port)
    if port is None:
        _no_such_port(node, src, info, "output", info.outputs, report)
        return None
    return port.type


def _dest(edge: EdgeInfo, stages, ports: PipelinePorts, report: Report):
    """(type or None, accepts streaming or None) for a resolvable destination, else None."""
    dst, node = edge.spec.dst, edge.dst_node
    if dst.stage == PIPELINE_OUTPUTS:
        if ports.outputs is None:
            return (None, None)
        if dst.port not in ports.outputs:
            report.add(
                _port_pos(node, dst),
                f"the pipeline has no output {dst.port!r}"
                f"{did_you_mean(dst.port, ports.outputs)}; outputs: "
                f"{', '.join(ports.outputs) or 'none'}",
            )
            return None
        return (ports.outputs[dst.port], True)  # outputs take chunks: they stream to the caller
    info = _stage(dst.stage, node, stages, report, "destination")
    if info is None:
        return None
    if info.inputs is None:
        return (None, None)
    port = info.inputs.get(dst.port)
    if port is None:
        _no_such_port(node, dst, info, "input", info.inputs, report)
        return None
    return (port.type, port.streaming)


def _no_such_port(
    node: ScalarNode, end: Endpoint, info: StageInfo, direction: str, declared: dict, report: Report
) -> None:
    report.add(
        _port_pos(node, end),
        f"stage {end.stage!r} (kind {info.kind_label}) has no {direction} port {end.port!r}"
        f"{did_you_mean(end.port, declared)}; {direction}s: {', '.join(declared) or 'none'}",
    )


def _stage(name: str, node: ScalarNode, stages: dict[str, StageInfo], report: Report, role: str) -> StageInfo | None:
    info = stages.get(name)
    if info is None:
        names = list(stages) + [PIPELINE_INPUTS, PIPELINE_OUTPUTS]
        report.add(node.pos, f"edge {role} {node.value!r}: no stage named {name!r}{did_you_mean(name, names)}")
    return info


def _check_cycles(stages: dict[str, StageInfo], edges: list[EdgeInfo], report: Report) -> None:
    """One problem per strongly connected component that holds a cycle, naming the cycle."""
    succ: dict[str, list[tuple[str, EdgeInfo]]] = {n: [] for n in stages}
    for edge in edges:
        a, b = edge.spec.src.stage, edge.spec.dst.stage
        if a in succ and b in succ:
            succ[a].append((b, edge))
    for component in _strongly_connected(list(stages), succ):
        members = set(component)
        if len(component) == 1 and not any(b == component[0] for b, _ in succ[component[0]]):
            continue
        start = min(component, key=lambda n: (stages[n].key_pos.line, stages[n].key_pos.col))
        path, path_edges = _cycle_from(start, succ, members)
        report.add(path_edges[0].spec.pos, f"cycle: {' -> '.join(path + [start])} (a pipeline graph must be acyclic)")


def _strongly_connected(nodes: list[str], succ) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # recursion depth = stages in a chain; pipelines are small
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w, _ in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            result.append(component)

    for v in nodes:
        if v not in index:
            visit(v)
    return result


def _cycle_from(start: str, succ, members: set[str]) -> tuple[list[str], list[EdgeInfo]]:
    """A simple cycle through `start` inside one strongly connected component (BFS back to it)."""
    parents: dict[str, tuple[str, EdgeInfo]] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for v in frontier:
            for w, edge in succ[v]:
                if w not in members:
                    continue
                if w == start:
                    path, path_edges = [v], [edge]
                    while path[0] != start:
                        parent, pedge = parents[path[0]]
                        path.insert(0, parent)
                        path_edges.insert(0, pedge)
                    return path, path_edges
                if w not in seen:
                    seen.add(w)
                    parents[w] = (v, edge)
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("a strongly connected component always holds a cycle")
