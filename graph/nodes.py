"""A YAML document as a tree of positioned nodes.

ruamel.yaml's round-trip loader knows where every key and value sits; this module copies that
into plain nodes (MapNode / SeqNode / ScalarNode, each with a SourcePos) so interpolation,
`--set` overrides and validation can edit and inspect the tree without caring about ruamel's
types. A YAML syntax error becomes a `Problem` at the parser's mark.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.scalarstring import ScalarString

from omnistage.graph.spec import SourcePos


@dataclass
class Problem:
    pos: SourcePos
    message: str

    def __str__(self) -> str:
        return f"{self.pos}: {self.message}"


@dataclass
class ScalarNode:
    value: Any  # str | int | float | bool | None
    pos: SourcePos
    quoted: bool = False  # written in quotes (sub-positions skip the opening quote)
    source_text: str | None = None  # the raw line(s) the scalar starts on, for sub-positions
    broken: bool = False  # already reported (failed interpolation): later checks stay quiet
    text: str | None = None  # an interpolated value's text: what a string-typed field reads

    def sub_pos(self, offset: int) -> SourcePos:
        """Position of character `offset` of a single-line string value, else the value's start."""
        if not isinstance(self.value, str) or "\n" in self.value or self.source_text is None:
            return self.pos
        start = self.pos.col - 1 + (1 if self.quoted else 0)
        if self.source_text[start : start + len(self.value)] != self.value:
            return self.pos
        return SourcePos(self.pos.file, self.pos.line, start + offset + 1)


@dataclass
class MapNode:
    pos: SourcePos
    entries: dict[str, Node] = field(default_factory=dict)
    key_pos: dict[str, SourcePos] = field(default_factory=dict)

    def get(self, key: str) -> Node | None:
        return self.entries.get(key)

    def set(self, key: str, node: Node, key_pos: SourcePos) -> None:
        self.entries[key] = node
        self.key_pos.setdefault(key, key_pos)


@dataclass
class SeqNode:
    pos: SourcePos
    items: list[Node] = field(default_factory=list)


Node = MapNode | SeqNode | ScalarNode


def plain(node: Node | None) -> Any:
    """The node's value as plain Python data (dicts, lists, scalars)."""
    if node is None:
        return None
    if isinstance(node, MapNode):
        return {k: plain(v) for k, v in node.entries.items()}
    if isinstance(node, SeqNode):
        return [plain(v) for v in node.items]
    return node.value


def broken_positions(node: Node) -> set[SourcePos]:
    if isinstance(node, MapNode):
        return set().union(*(broken_positions(c) for c in node.entries.values()))
    if isinstance(node, SeqNode):
        return set().union(*(broken_positions(c) for c in node.items))
    return {node.pos} if node.broken else set()


def describe(node: Node) -> str:
    if isinstance(node, MapNode):
        return "a mapping"
    if isinstance(node, SeqNode):
        return "a list"
    value = node.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {value}"
    if isinstance(value, (int, float)):
        return f"number {value}"
    return f"string {value!r}"


def _yaml() -> YAML:
    y = YAML(typ="rt")
    y.preserve_quotes = True
    return y


def _pos(file: str, line0: int, col0: int) -> SourcePos:
    return SourcePos(file, line0 + 1, col0 + 1)


def _scalar_value(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return value  # dates and other exotic scalars: validation reports the wrong type


def _convert(obj: Any, pos: SourcePos, file: str, lines: list[str]) -> Node:
    if isinstance(obj, dict):
        node = MapNode(pos)
        for key, value in obj.items():
            kl, kc = obj.lc.key(key)
            vl, vc = obj.lc.value(key)
            key_str = str(key)  # non-string keys (`1: x`) are reported by name checks
            node.entries[key_str] = _convert(value, _pos(file, vl, vc), file, lines)
            node.key_pos[key_str] = _pos(file, kl, kc)
        return node
    if isinstance(obj, list):
        node = SeqNode(pos)
        for i, value in enumerate(obj):
            il, ic = obj.lc.item(i)
            node.items.append(_convert(value, _pos(file, il, ic), file, lines))
        return node
    line = lines[pos.line - 1] if 0 < pos.line <= len(lines) else None
    return ScalarNode(
        _scalar_value(obj), pos, quoted=isinstance(obj, ScalarString) and _is_quoted(obj), source_text=line
    )


def _is_quoted(value: ScalarString) -> bool:
    style = getattr(value, "style", None)
    return style in ("'", '"')


def parse_yaml(text: str, file: str, value: bool = False) -> tuple[Node | None, list[Problem]]:
    """Parse YAML text into a node tree; a syntax error comes back as one Problem. `value`: the
    text is one value (an override's, an interpolated one), where `null` is a value, not an
    empty file."""
    try:
        data = _yaml().load(text)
    except MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line, col = (mark.line, mark.column) if mark is not None else (0, 0)
        message = err.problem or err.context or "invalid YAML"
        if err.context and err.problem:
            message = f"{err.problem} ({err.context})"
        return None, [Problem(_pos(file, line, col), f"YAML syntax error: {message}")]
    except YAMLError as err:
        return None, [Problem(SourcePos(file, 1, 1), f"YAML syntax error: {err}")]
    lines = text.splitlines()
    if data is None and value:
        return ScalarNode(None, SourcePos(file, 1, 1)), []
    if data is None:
        return None, [
            Problem(
                SourcePos(file, 1, 1),
                "the file is empty; a pipeline is a mapping with name, inputs, outputs, stages, edges",
            )
        ]
    start = SourcePos(file, 1, 1)
    if isinstance(data, (dict, list)):
        start = _pos(file, data.lc.line, data.lc.col)
    return _convert(data, start, file, lines), []
