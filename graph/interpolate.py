"""`${VAR}` / `${VAR:-default}` / `${VAR-default}` in string values, read from the environment.

Shell semantics: `:-` uses the default when VAR is unset or empty, `-` only when unset.
`$${` is a literal `${`. A value that is exactly one `${...}` (quoted or not: flow mappings
need the quotes) is re-read as YAML after substitution, so `replicas: "${REPLICAS:-2}"` is the
number 2 and `devices: "${DEVS:-[cpu]}"` a list; a field that takes a string still reads the
substituted text (`name: "${VERSION}"` with VERSION=2 is the string "2"). Values with other
text around the reference stay strings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from omnistage.graph.nodes import MapNode, Node, Problem, ScalarNode, SeqNode, parse_yaml

_REF = re.compile(r"\$\$\{|\$\{([^}]*)\}")
_NAME_AND_DEFAULT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)(.*))?$", re.S)


def interpolate(node: Node, environ: Mapping[str, str], problems: list[Problem]) -> Node:
    """Substitute references in every string scalar below `node` (in place for containers)."""
    if isinstance(node, MapNode):
        for key, child in node.entries.items():
            node.entries[key] = interpolate(child, environ, problems)
        return node
    if isinstance(node, SeqNode):
        node.items = [interpolate(child, environ, problems) for child in node.items]
        return node
    if not isinstance(node.value, str) or "$" not in node.value:
        return node
    return _substitute(node, environ, problems)


def _substitute(node: ScalarNode, environ: Mapping[str, str], problems: list[Problem]) -> Node:
    text: str = node.value
    out: list[str] = []
    last = 0
    ok = True
    for match in _REF.finditer(text):
        out.append(text[last : match.start()])
        last = match.end()
        if match.group(0) == "$${":
            out.append("${")
            continue
        parsed = _NAME_AND_DEFAULT.match(match.group(1))
        where = node.sub_pos(match.start())
        if parsed is None:
            problems.append(
                Problem(
                    where,
                    f"malformed variable reference {match.group(0)!r}; "
                    "write ${NAME}, ${NAME:-default} or ${NAME-default}",
                )
            )
            ok = False
            continue
        name, op, default = parsed.groups()
        value = environ.get(name)
        if op == ":-" and not value:
            value = default
        elif op == "-" and value is None:
            value = default
        if value is None:
            problems.append(
                Problem(
                    where,
                    f"environment variable {name} is not set and "
                    f"{match.group(0)!r} gives no default "
                    f"(write ${{{name}:-default}})",
                )
            )
            ok = False
            continue
        out.append(value)
    out.append(text[last:])
    if not ok:
        node.broken = True
        return node
    result = "".join(out)
    whole = _REF.fullmatch(text) is not None and not text.startswith("$${")
    if whole:
        reread, errors = parse_yaml(result, node.pos.file, value=True) if result.strip() else (None, [])
        if not errors and reread is not None:
            reread = _relocate(reread, node)
            if isinstance(reread, ScalarNode):
                reread.text = result
            return reread
    return ScalarNode(result, node.pos, quoted=node.quoted, text=result)


def _relocate(node: Node, at: ScalarNode) -> Node:
    """Give a re-read value (and everything inside it) the position of the reference."""
    if isinstance(node, MapNode):
        node.pos = at.pos
        node.key_pos = {k: at.pos for k in node.key_pos}
        for child in node.entries.values():
            _relocate(child, at)
    elif isinstance(node, SeqNode):
        node.pos = at.pos
        for child in node.items:
            _relocate(child, at)
    else:
        node.pos = at.pos
        node.source_text = None
    return node
