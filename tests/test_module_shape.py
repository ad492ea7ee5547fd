"""Every product module stays readable: at most 500 lines, no function over 80, so each
file stays easy to enter for the next contributor."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = ("graph", "stages", "runtime", "serving", "ray_serve", "streaming", "kernels", "models")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _shape_problems(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    where = path.relative_to(ROOT)
    problems = []
    if text.count("\n") > MAX_MODULE_LINES:
        problems.append(f"{where}: {text.count(chr(10))} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                problems.append(f"{where}:{node.lineno}: {node.name} has {length} lines")
    return problems


@pytest.mark.parametrize("package", PRODUCT_PACKAGES)
def test_no_long_modules_or_functions(package):
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules, f"{package}/ holds no modules: the walk is looking in the wrong place"
    problems = [p for path in modules for p in _shape_problems(path)]
    assert not problems, "split these: " + "; ".join(problems)
