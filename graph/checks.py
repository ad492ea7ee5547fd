"""Small positioned checks shared by the section validators: keys, scalar fields, names."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

from omnistage.graph.fields import Field
from omnistage.graph.nodes import MapNode, Node, Problem, ScalarNode, SeqNode, describe
from omnistage.graph.spec import SourcePos

# Common spellings difflib would not match to the format's words.
ALIASES = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "gpu": "cuda",
    "continous": "continuous",
}


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    choices = list(choices)
    alias = ALIASES.get(str(word).lower())
    if alias in choices:
        return f" (did you mean {alias!r}?)"
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Report:
    """Collects every problem; validators keep going after each one."""

    def __init__(self, problems: list[Problem] | None = None):
        self.problems: list[Problem] = problems if problems is not None else []
        self.muted: set[SourcePos] = set()  # positions already reported upstream

    def add(self, pos: SourcePos, message: str) -> None:
        if pos in self.muted:
            return
        self.problems.append(Problem(pos, message))

    def __bool__(self) -> bool:
        return bool(self.problems)

    # -- mappings ---------------------------------------------------------------------------
    def mapping(self, node: Node | None, where: str, at: SourcePos) -> MapNode | None:
        """`node` if it is a mapping (null counts as an empty one), else a problem and None."""
        if node is None:
            return None
        if isinstance(node, ScalarNode) and node.value is None:
            return MapNode(node.pos)
        if not isinstance(node, MapNode):
            self.add(node.pos, f"{where} must be a mapping, got {describe(node)}")
            return None
        return node

    def keys(self, node: MapNode, fields: dict[str, Field], where: str, at: SourcePos) -> None:
        """Unknown keys (with a did-you-mean) and missing required ones."""
        suggested: set[str] = set()
        for key in node.entries:
            if key in fields:
                continue
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
            if close:
                suggested.add(close[0])
                hint = f" (did you mean {close[0]!r}?)"
            else:
                hint = f"; expected one of: {', '.join(fields)}"
            self.add(node.key_pos[key], f"unknown key {key!r} in {where}{hint}")
        for key, field in fields.items():
            if field.required and key not in node.entries and key not in suggested:
                self.add(at, f"{where}: missing required field {key!r} ({field.doc})")

    # -- scalars ----------------------------------------------------------------------------
    def scalar(self, node: Node, field: Field, where: str) -> tuple[bool, Any]:
        """Check a scalar against `field`: (ok, value)."""
        if not isinstance(node, ScalarNode):
            self.add(node.pos, f"{where} must be {_type_words(field)}, got {describe(node)}")
            return False, None
        value = node.value
        if field.type == "string" and node.text is not None:
            value = node.text  # interpolated: a string field takes the text, not its YAML reading
        if value is None:
            if field.nullable:
                return True, None
            self.add(node.pos, f"{where} must be {_type_words(field)}, got null")
            return False, None
        if not _type_ok(value, field.type):
            self.add(node.pos, f"{where} must be {_type_words(field)}, got {describe(node)}")
            return False, None
        if field.enum is not None and value not in field.enum:
            self.add(
                node.pos, f"{where}: {value!r} is not one of {', '.join(field.enum)}{did_you_mean(value, field.enum)}"
            )
            return False, None
        if field.pattern is not None and not re.match(field.pattern, value):
            self.add(node.pos, f"{where}: {value!r} is not a valid name (must match {field.pattern})")
            return False, None
        if field.minimum is not None and value < field.minimum:
            self.add(node.pos, f"{where} must be >= {_num(field.minimum)}, got {value}")
            return False, None
        if field.exclusive_minimum is not None and value <= field.exclusive_minimum:
            self.add(node.pos, f"{where} must be > {_num(field.exclusive_minimum)}, got {value}")
            return False, None
        return True, value

    def fields(self, node: MapNode, fields: dict[str, Field], where: str) -> dict[str, Any]:
        """Check every present non-special scalar field; the valid values by key."""
        values: dict[str, Any] = {}
        for key, field in fields.items():
            child = node.get(key)
            if child is None or field.type in ("special", "mapping", "list"):
                continue
            ok, value = self.scalar(child, field, f"{where}.{key}" if where else key)
            if ok:
                values[key] = value
        return values

    def seq(self, node: Node, where: str) -> SeqNode | None:
        if isinstance(node, SeqNode):
            return node
        if isinstance(node, ScalarNode) and node.value is None:
            return SeqNode(node.pos)
        self.add(node.pos, f"{where} must be a list, got {describe(node)}")
        return None


def _type_ok(value: Any, type_: str) -> bool:
    if type_ == "string":
        return isinstance(value, str)
    if type_ == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if type_ == "integer":
        return isinstance(value, int)
    if type_ == "number":
        return isinstance(value, (int, float))
    return True


def _type_words(field: Field) -> str:
    words = {
        "string": "a string",
        "integer": "an integer",
        "number": "a number",
        "boolean": "true or false",
        "mapping": "a mapping",
        "list": "a list",
    }.get(field.type, "a value")
    if field.minimum is not None:
        words += f" >= {_num(field.minimum)}"
    if field.exclusive_minimum is not None:
        words += f" > {_num(field.exclusive_minimum)}"
    if field.nullable:
        words += " (or null)"
    return words


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
