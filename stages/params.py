"""Declared parameters: one way for every stage kind to state what it accepts.

A stage kind declares two `ParamSet`s as class attributes of its `StageEngine` subclass:

    stage_params      the YAML `params:` of a stage (checked when the pipeline file loads)
    request_params    what one request may send under `params: {stage_name: {...}}`

Each `Param` states a name, a type, a range or choices, a default and a description. From
these declarations come the checks (every bad value raises the same `InvalidRequestError`
whose `.param` names the parameter), the JSON Schema and the markdown tables in docs/params.md.

Stable API for other layers (serving lists a pipeline's params with these):

    kind_params(kind) -> KindParams             the two ParamSets of a registered stage kind
    KindParams.describe() -> dict               {"kind", "stage_params": schema,
                                                 "request_params": schema}
    ParamSet.json_schema() -> dict              JSON Schema object: properties with type,
                                                 minimum/maximum, enum, default, description;
                                                 required; additionalProperties = ParamSet.open
    ParamSet.describe() -> list[dict]           [{name, type, nullable, required, default,
                                                  range, description}]
    ParamSet.open                               True: undeclared keys pass to the stage as is
    ParamSet.validate(raw) -> dict              checked values, defaults filled in; raises
                                                 InvalidRequestError(param=<name>) on the first
                                                 bad or unknown key
    ParamSet.problems(raw) -> list[str]         every problem, as messages (YAML validation)
    params_markdown() -> str                    docs/params.md's tables, every kind
    params_doc() -> str                         docs/params.md (python -m omnistage.stages.params)

A bad value's message reads "<name> must be <what>, got <value>"; an unknown key's names the
set and suggests the closest declared name.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from omnistage.errors import InvalidRequestError

# JSON Schema fragment and a readable noun for each declared type.
_TYPES: dict[str, tuple[dict[str, Any], str]] = {
    "integer": ({"type": "integer"}, "an integer"),
    "number": ({"type": "number"}, "a number"),
    "boolean": ({"type": "boolean"}, "a boolean"),
    "string": ({"type": "string"}, "a string"),
    "integer_list": ({"type": "array", "items": {"type": "integer"}}, "a list of integers"),
    "string_list": ({"type": "array", "items": {"type": "string"}}, "a list of strings"),
    "string_or_list": (
        {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "a string or a list of strings",
    ),
    "size": (
        {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        'a byte count or a size such as "512MiB"',
    ),
    "mapping": ({"type": "object"}, "a mapping"),
    "any": ({}, "any value"),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "integer": _is_int,
    "number": _is_number,
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    # set(map(type, ...)) is checked in C: token-id lists can be long
    "integer_list": lambda v: isinstance(v, (list, tuple)) and (set(map(type, v)) <= {int}),
    "string_list": _is_str_list,
    "string_or_list": lambda v: isinstance(v, str) or _is_str_list(v),
    "size": lambda v: _is_int(v) or isinstance(v, str),
    "mapping": lambda v: isinstance(v, Mapping),
    "any": lambda v: True,
}


@dataclass(frozen=True)
class Param:
    """One declared parameter.

    minimum/maximum bound numbers (and each item of an integer_list); exclusive_* make the
    bound strict. choices: the allowed values. nullable: None is accepted (and means "the
    default decided elsewhere", e.g. the model family's). check: an extra rule on a value of
    the right type, returning a problem ("must be ...") or None. required: must be given.
    """

    name: str
    type: str
    default: Any = None
    description: str = ""
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    choices: tuple[Any, ...] | None = None
    nullable: bool = False
    check: Callable[[Any], str | None] | None = None
    required: bool = False

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise ValueError(f"param {self.name!r}: unknown type {self.type!r} (known: {', '.join(_TYPES)})")

    # -- checking -------------------------------------------------------------------------
    def range_text(self) -> str:
        """The bounds as text: '>= 1', 'in (0, 1]', '' when unbounded."""
        lo, hi = self.minimum, self.maximum
        if lo is not None and hi is not None:
            left = "(" if self.exclusive_minimum else "["
            right = ")" if self.exclusive_maximum else "]"
            return f"in {left}{_num(lo)}, {_num(hi)}{right}"
        if lo is not None:
            return f"{'>' if self.exclusive_minimum else '>='} {_num(lo)}"
        if hi is not None:
            return f"{'<' if self.exclusive_maximum else '<='} {_num(hi)}"
        return ""

    def expected(self) -> str:
        """What a good value looks like, for error messages."""
        if self.choices is not None:
            text = f"one of {', '.join(map(str, self.choices))}"
        else:
            text = _TYPES[self.type][1]
            bounds = self.range_text()
            if bounds:
                text += (" each " if self.type == "integer_list" else " ") + bounds
        return text + (" or null" if self.nullable else "")

    def _closest_choice(self, value: Any) -> str:
        if not isinstance(value, str):
            return ""
        close = difflib.get_close_matches(value, [c for c in self.choices if isinstance(c, str)], n=1)
        return f" (did you mean {close[0]!r}?)" if close else ""

    def _in_range(self, x: float) -> bool:
        lo, hi = self.minimum, self.maximum
        if lo is not None and (x <= lo if self.exclusive_minimum else x < lo):
            return False
        return not (hi is not None and (x >= hi if self.exclusive_maximum else x > hi))

    def problem(self, value: Any) -> str | None:
        """None when `value` is acceptable, else the message (naming the parameter)."""
        if value is None:
            return None if self.nullable else f"{self.name} must be {self.expected()}, got null"
        if not _TYPE_CHECKS[self.type](value):
            return f"{self.name} must be {self.expected()}, got {_show(value)}"
        if self.choices is not None and value not in self.choices:
            return f"{self.name} must be {self.expected()}, got {_show(value)}{self._closest_choice(value)}"
        if self.minimum is not None or self.maximum is not None:
            items = value if self.type == "integer_list" else (value,)
            if not all(map(self._in_range, items)):
                return f"{self.name} must be {self.expected()}, got {_show(value)}"
        if self.check is not None:
            why = self.check(value)
            if why:
                return f"{self.name} {why}, got {_show(value)}"
        return None

    # -- description ----------------------------------------------------------------------
    def json_schema(self) -> dict[str, Any]:
        schema = dict(_TYPES[self.type][0])
        bound = "items" if self.type == "integer_list" else None
        target = dict(schema["items"]) if bound else schema
        if self.minimum is not None:
            target["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = self.minimum
        if self.maximum is not None:
            target["exclusiveMaximum" if self.exclusive_maximum else "maximum"] = self.maximum
        if bound:
            schema["items"] = target
        if self.choices is not None:
            schema["enum"] = list(self.choices)
        if self.nullable:
            schema = {"anyOf": [schema, {"type": "null"}]}
        if self.default is not None:
            schema["default"] = self.default
        if self.description:
            schema["description"] = self.description
        return schema

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "nullable": self.nullable,
            "required": self.required,
            "default": self.default,
            "range": f"one of {', '.join(map(str, self.choices))}" if self.choices else self.range_text(),
            "description": self.description,
        }


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# A rule over several values: returns (param, message) for the first violation, or None.
Rule = Callable[[dict[str, Any]], "tuple[str, str] | None"]


@dataclass(frozen=True)
class ParamSet:
    """The parameters one stage kind accepts in one place (YAML params or per request).

    owner names the set in messages about unknown keys ("ar_lm request").
    rules: checks across several values (e.g. min_tokens <= max_tokens), run after each
    value passed its own check.
    open: keys that are not declared pass unchecked (a user module that reads its own params);
    otherwise an unknown key is an error.
    """

    owner: str
    params: tuple[Param, ...] = ()
    rules: tuple[Rule, ...] = ()
    open: bool = False
    # why an empty set takes nothing, in the message about an unknown key
    empty_hint: str = "this stage kind takes none"
    doc: str = ""  # what docs/params.md says instead of the table (a set that depends on the stage)
    by_name: dict[str, Param] = field(init=False, repr=False, compare=False)
    required: tuple[Param, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {p.name: p for p in self.params}
        if len(by_name) != len(self.params):
            raise ValueError(f"{self.owner}: a parameter is declared twice")
        object.__setattr__(self, "by_name", by_name)
        object.__setattr__(self, "required", tuple(p for p in self.params if p.required))

    def __iter__(self) -> Iterator[Param]:
        return iter(self.params)

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def __len__(self) -> int:
        return len(self.params)

    def names(self) -> list[str]:
        return list(self.by_name)

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def extended(self, owner: str, params: Iterable[Param] = (), rules: Iterable[Rule] = ()) -> ParamSet:
        """This set plus more params and rules, under a new owner name."""
        return ParamSet(owner, self.params + tuple(params), self.rules + tuple(rules), self.open)

    # -- checking -------------------------------------------------------------------------
    def unknown_message(self, key: str) -> str:
        if not self.by_name:
            return f"unknown {self.owner} parameter {key!r}: {self.empty_hint}"
        close = difflib.get_close_matches(key, self.by_name, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown {self.owner} parameter {key!r}{hint}; known: {', '.join(self.by_name)}"

    def validate(self, raw: Mapping[str, Any] | None, fill_defaults: bool = True) -> dict[str, Any]:
        """Checked values (declared defaults for the missing ones when fill_defaults).
        Raises InvalidRequestError naming the first unknown or bad parameter."""
        raw = raw or {}
        for key, value in raw.items():
            why = self.key_problem(key, value)
            if why:
                raise InvalidRequestError(why, param=key)
        for p in self.required:
            if p.name not in raw:
                raise InvalidRequestError(f"{p.name} is required: {p.description}", param=p.name)
        values = {**self.defaults(), **raw} if fill_defaults else dict(raw)
        for rule in self.rules:
            found = rule(values)
            if found:
                raise InvalidRequestError(found[1], param=found[0])
        return values

    def check_values(self, values: Mapping[str, Any]) -> None:
        """Check already-complete values (e.g. a dataclass's fields); raise on the first problem."""
        self.validate(values, fill_defaults=False)

    def key_problem(self, key: str, value: Any) -> str | None:
        """What is wrong with one key and its value (unknown name, bad value), or None."""
        p = self.by_name.get(key)
        if p is None:
            return None if self.open else self.unknown_message(key)
        return p.problem(value)

    def problems(self, raw: Mapping[str, Any] | None) -> list[str]:
        """Every problem with `raw`, as messages (for YAML validation, which lists them all)."""
        raw = raw or {}
        problems = [why for why in (self.key_problem(k, v) for k, v in raw.items()) if why]
        problems += [f"{p.name} is required: {p.description}" for p in self.required if p.name not in raw]
        if not problems:
            values = {**self.defaults(), **raw}
            problems = [found[1] for found in (rule(values) for rule in self.rules) if found]
        return problems

    # -- description ----------------------------------------------------------------------
    def json_schema(self) -> dict[str, Any]:
        schema = {
            "type": "object",
            "title": self.owner,
            "properties": {p.name: p.json_schema() for p in self.params},
            "additionalProperties": self.open,
        }
        if self.required:
            schema["required"] = [p.name for p in self.required]
        return schema

    def describe(self) -> list[dict[str, Any]]:
        return [p.describe() for p in self.params]

    def markdown_table(self) -> str:
        if self.doc:
            return self.doc + "\n"
        if not self.params:
            return "Any keys (passed on unchecked).\n" if self.open else "None.\n"
        lines = ["| param | type | default | range | description |", "|---|---|---|---|---|"]
        for d in self.describe():
            kind = d["type"] + (" or null" if d["nullable"] else "") + (", required" if d["required"] else "")
            default = "" if d["default"] is None else f"`{_markdown_value(d['default'])}`"
            cells = [f"`{d['name']}`", kind, default, d["range"], d["description"]]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        return "\n".join(lines) + "\n"


def _markdown_value(value: Any) -> str:
    return json.dumps(value)


NO_PARAMS = ParamSet("stage")
# A request's seed: torch generators take -2**63 .. 2**64 - 1, and n sequences use seed + i.
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class KindParams:
    """The declared params of one stage kind."""

    kind: str
    stage: ParamSet
    request: ParamSet

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "stage_params": self.stage.json_schema(),
            "request_params": self.request.json_schema(),
        }


def kind_params(kind: str) -> KindParams:
    """The declared stage and request params of a registered stage kind (KeyError if unknown)."""
    from omnistage.stages.registry import get_stage_class

    cls = get_stage_class(kind)
    return KindParams(kind, cls.stage_params, cls.request_params)


def stage_request_params(stage: Any) -> ParamSet:
    """What one request may send to a stage (a StageSpec): its kind's request params as its
    YAML `params:` narrow them (KeyError for a kind that is not registered)."""
    from omnistage.stages.registry import get_stage_class

    return get_stage_class(stage.kind).request_params_for(stage.params or {})


DOC_HEADER = """# Stage parameters

Every stage kind declares its parameters in code (`stage_params` and `request_params` of its
class, see `stages/params.py`); the tables below are generated from those declarations, so
they are what the server checks. Stage params go under a stage's `params:` in the pipeline
YAML and are checked when the file loads; per-request params go under
`params: {STAGE_NAME: {...}}` of a request. An unknown key or a bad value fails the request
with HTTP 400 whose error `param` names the parameter.

Regenerate after changing a declaration (from the checkout's root):

<!-- doc-test: skip edits the checkout -->
```sh
python -m omnistage.stages.params > docs/params.md
```

"""


def params_doc() -> str:
    """docs/params.md as generated from the declarations."""
    return DOC_HEADER + params_markdown()


def params_markdown(kinds: Iterable[str] | None = None) -> str:
    """Markdown tables of every (or the given) stage kind's params, as docs/params.md holds."""
    from omnistage.stages.registry import KIND_MODULES

    parts = []
    for kind in kinds if kinds is not None else sorted(KIND_MODULES):
        kp = kind_params(kind)
        parts.append(f"## `{kind}`\n\nStage params (YAML `params:`):\n\n{kp.stage.markdown_table()}")
        parts.append(f"Per-request params (`params: {{stage: {{...}}}}`):\n\n{kp.request.markdown_table()}")
    return "\n".join(parts)


if __name__ == "__main__":
    print(params_doc(), end="")
