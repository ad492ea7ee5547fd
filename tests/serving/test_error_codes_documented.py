"""docs/serving.md's error table and the code agree on the error codes: every `code` the
serving layer or an omnistage error class can answer with is in the table, and every code in
the table is one the code can produce."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import omnistage
from omnistage.errors import OmnistageError

ROOT = Path(omnistage.__file__).parent


def _documented_codes() -> set[str]:
    text = (ROOT / "docs" / "serving.md").read_text()
    table = text[text.index("| cause | status | code |") :].split("\n\n")[0]
    codes = set()
    for row in table.splitlines()[2:]:
        cell = re.sub(r"\(.*?\)|`param: [^`]*`", "", row.split("|")[3])  # notes about `param` are not codes
        codes.update(re.findall(r"`([a-z_]+)`", cell))
    return codes


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _codes_in_code() -> set[str]:
    for module in pkgutil.walk_packages([str(ROOT / "serving")], "omnistage.serving."):
        importlib.import_module(module.name)
    codes = {cls.code for cls in [OmnistageError, *_subclasses(OmnistageError)]}
    # the routes answer with the media checks the stages share (stages/media_limits.py)
    for path in [*(ROOT / "serving").rglob("*.py"), ROOT / "stages" / "media_limits.py"]:
        source = path.read_text()
        codes.update(re.findall(r'\bcode\s*=\s*"([a-z_]+)"', source))
        codes.update(re.findall(r'\bcode\s*=\s*"[a-z_]+" if .+ else "([a-z_]+)"', source))
        # error bodies built by position: _reject(kind, send, 413, "body_too_large", ...)
        codes.update(re.findall(r'_reject\(kind, send, \d+, "([a-z_]+)"', source))
    codes.discard("service_unavailable")  # ServiceUnavailableError is always raised with its own code
    codes.discard("cancelled")  # the client is gone: nobody receives this one
    return codes


def test_error_table_matches_the_codes_the_server_answers_with():
    documented, produced = _documented_codes(), _codes_in_code()
    assert produced - documented == set(), f"codes missing from docs/serving.md: {produced - documented}"
    assert documented - produced == set(), f"documented codes no code produces: {documented - produced}"
