"""Every module under stages/ stays readable: at most 500 lines, no function over 80 (issue 10's
bound, so the next stage kinds start from rooms that are easy to enter)."""

import ast
from pathlib import Path

STAGES = Path(__file__).resolve().parents[1] / "stages"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def test_no_long_modules_or_functions_under_stages():
    problems = []
    for path in sorted(STAGES.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(STAGES.parent)
        if text.count("\n") > MAX_MODULE_LINES:
            problems.append(f"{where}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    problems.append(f"{where}:{node.lineno}: {node.name} has {length} lines")
    assert not problems, "split these: " + "; ".join(problems)
