"""`--set PATH=VALUE` overrides applied to the node tree before validation.

PATH is dotted (`stages.llm.pool.devices`; list items by index: `edges.0.max_inflight`);
VALUE is read as YAML (`[cuda:0, cuda:1]`, `4`, `bfloat16`). Missing mappings along the path
are created, so `stages.llm.pool.replicas=2` works when the file has no `pool:`; keys the
format does not know are then reported by validation, at the override. Overrides cannot
create stages or list items. Positions inside an override are `<--set #N>:1:COL`, COL
counting characters of the `PATH=VALUE` argument.
"""

from __future__ import annotations

import difflib

from omnistage.graph.nodes import MapNode, Node, Problem, ScalarNode, SeqNode, parse_yaml
from omnistage.graph.spec import SourcePos


def override_file(index: int) -> str:
    return f"<--set #{index + 1}>"


def apply_overrides(root: Node, overrides: list[str] | tuple[str, ...], problems: list[Problem]) -> None:
    for index, text in enumerate(overrides):
        _apply_one(root, index, text, problems)


def _apply_one(root: Node, index: int, text: str, problems: list[Problem]) -> None:
    file = override_file(index)
    at = SourcePos(file, 1, 1)
    path, eq, value_text = text.partition("=")
    if not eq or not path.strip():
        problems.append(Problem(at, f"override {text!r} is not PATH=VALUE (e.g. stages.llm.pool.devices=[cuda:0])"))
        return
    segments = path.split(".")
    value_col = len(path) + 2
    value_node, errors = parse_yaml(value_text, file, value=True) if value_text.strip() else (None, [])
    for err in errors:
        problems.append(Problem(SourcePos(file, 1, err.pos.col + value_col - 1), err.message))
    if errors:
        return
    if value_node is None:
        value_node = ScalarNode(None, SourcePos(file, 1, value_col))
    _shift(value_node, value_col - 1)

    node = root
    col = 1
    for depth, segment in enumerate(segments):
        seg_pos = SourcePos(file, 1, col)
        where = ".".join(segments[:depth]) or "the top level"
        is_last = depth == len(segments) - 1
        if not segment:
            problems.append(Problem(seg_pos, f"override path {path!r} has an empty segment"))
            return
        if isinstance(node, SeqNode):
            if not segment.isdigit() or int(segment) >= len(node.items):
                problems.append(
                    Problem(
                        seg_pos,
                        f"unknown override path {path!r}: {where} is a list "
                        f"of {len(node.items)} items; use an index 0.."
                        f"{max(len(node.items) - 1, 0)}",
                    )
                )
                return
            if is_last:
                node.items[int(segment)] = value_node
                return
            node = node.items[int(segment)]
        elif isinstance(node, MapNode):
            child = node.get(segment)
            if child is None and where == "stages" and depth == 1:
                hint = _did_you_mean(segment, list(node.entries))
                problems.append(Problem(seg_pos, f"unknown override path {path!r}: no stage named {segment!r}{hint}"))
                return
            if is_last:
                node.set(segment, value_node, seg_pos)
                return
            if child is None or (isinstance(child, ScalarNode) and child.value is None):
                child = MapNode(seg_pos)
                node.set(segment, child, seg_pos)
            node = child
        else:
            problems.append(
                Problem(seg_pos, f"unknown override path {path!r}: {where} is a single value, not a mapping")
            )
            return
        col += len(segment) + 1


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _shift(node: Node, by: int) -> None:
    """Move positions parsed from the VALUE text to their column in the whole argument."""
    node.pos = SourcePos(node.pos.file, 1, node.pos.col + by)
    if isinstance(node, MapNode):
        node.key_pos = {k: SourcePos(p.file, 1, p.col + by) for k, p in node.key_pos.items()}
        for child in node.entries.values():
            _shift(child, by)
    elif isinstance(node, SeqNode):
        for child in node.items:
            _shift(child, by)
    else:
        node.source_text = None
