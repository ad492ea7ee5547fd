"""Imports go one way: serving -> runtime -> graph -> stages -> (kernels, models, errors), with
streaming beneath serving, and graph sees stages only through their interface modules. A module that imports a layer above its own (at run time, counting
imports inside functions; `if TYPE_CHECKING:` blocks are only for annotations) is listed."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOTTOM = {"kernels", "models", "errors"}
# package -> the omnistage packages its modules may import (besides its own)
ALLOWED = {
    # the Ray backend hosts the serving app as its ingress: the one layer above serving
    "ray_serve": {"serving", "runtime", "graph", "stages", "streaming"} | BOTTOM,
    "serving": {"runtime", "graph", "stages", "streaming"} | BOTTOM,
    "runtime": {"graph", "stages"} | BOTTOM,
    "graph": {"stages"} | BOTTOM,
    "streaming": {"stages"} | BOTTOM,
    "stages": BOTTOM,
    "kernels": {"errors"},
    "models": {"errors"},
}
# graph checks a pipeline against the stage kinds through their interface, not their engines
STAGE_INTERFACE = {"omnistage.stages.contracts", "omnistage.stages.base", "omnistage.stages.registry"}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skipped.update(id(inner) for inner in ast.walk(node))
    return skipped


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for each run-time import of an omnistage module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "omnistage":  # from omnistage import runtime
                names = [f"omnistage.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.startswith("omnistage.")]
    return found


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, omnistage package) for each run-time import of an omnistage module."""
    return [(line, name.split(".")[1]) for line, name in imported_modules(path)]


def upward_imports(package: str) -> list[str]:
    problems = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, target in imported_packages(path):
            if target != package and target not in ALLOWED[package]:
                problems.append(f"{path.relative_to(ROOT)}:{line} imports omnistage.{target}")
    return problems


def test_the_walk_sees_imports(tmp_path):
    # a module-level, a function-level and a TYPE_CHECKING import: the first two count
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "from omnistage.graph.spec import PipelineSpec\n"
        "if TYPE_CHECKING:\n    import omnistage.serving.app\n"
        "def f():\n    from omnistage import runtime\n"
    )
    assert imported_packages(probe) == [(2, "graph"), (6, "runtime")]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_upward_imports(package):
    problems = upward_imports(package)
    assert not problems, "imports against the layering: " + "; ".join(problems)


def test_graph_sees_stages_through_their_interface():
    problems = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in sorted((ROOT / "graph").rglob("*.py"))
        for line, name in imported_modules(path)
        if name.startswith("omnistage.stages") and name not in STAGE_INTERFACE
    ]
    assert not problems, "graph imports stage internals: " + "; ".join(problems)
