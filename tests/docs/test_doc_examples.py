"""Every shell and Python example in README.md and docs/*.md runs as written.

Convention for the documentation (also in docs/serving.md, "Examples in the docs"):

- An example is a fenced code block whose info string is `sh`, `bash`, `shell` (run with
  bash, `set -e -o pipefail`: every command must succeed; curl fails on an HTTP error
  status) or `python` (run with the venv's python).
- A block that is not meant to run as written uses another info string: `text` for
  synopses, API summaries with placeholders and output, `yaml`, `json`, `console`, ...
- A runnable-looking block that must not run here (it serves until Ctrl+C, runs for
  minutes, needs a GPU or edits the checkout) keeps its language and has the marker
  `<!-- doc-test: skip REASON -->` on the line right above its fence; the reason is required.
- Indented (unfenced) code blocks are not run, so one that looks like a command or Python
  fails this test: fence it with the right info string.

How examples run: in a fresh temporary directory holding a `configs` link to the package's
configs (so `configs/tiny-llm.yaml` resolves and nothing is written into the checkout), with
the venv's bin first on PATH and PYTHONSAFEPATH=1. Examples that talk to a server
(`localhost:8000` or `127.0.0.1:8000` in their text) are pointed at one live
`omnistage serve` of the tiny pipelines on a free port (the session's, tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"sh": "shell", "bash": "shell", "shell": "shell", "python": "python"}
SKIP_MARK = re.compile(r"<!--\s*doc-test:\s*skip\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
# the first line of an indented block that is a command or Python, i.e. an unfenced example
LOOKS_RUNNABLE = re.compile(
    r"^\s*(\$ )?(omnistage |curl |make |python|pip |PYTHONSAFEPATH=|\.venv/|from [\w.]+ import |import [\w.]+|"
    r"with \w+|async for |await )"
)
SERVER_ADDRESS = re.compile(r"(localhost|127\.0\.0\.1):8000")
EXAMPLE_TIMEOUT_S = 240


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence (or first indented line)
    lang: str  # info string; "" for unlabelled, "indented" for indented blocks
    code: str
    skip_reason: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    blocks, i, in_list = [], 0, False
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith(fence.group(2)):
                end += 1
            prev = lines[i - 1] if i else ""
            mark = SKIP_MARK.search(prev)
            indent = len(fence.group(1))
            code = "\n".join(row[indent:] for row in lines[i + 1 : end])
            blocks.append(Block(path, i + 1, fence.group(3).lower(), code, mark.group(1) if mark else None))
            i = end + 1
            continue
        # An indented block starts after a blank line; list continuations are not code.
        if line.strip():
            in_list = bool(re.match(r"^\s*([-*+]|\d+\.)\s", line)) or (in_list and line.startswith(" "))
        if line.startswith("    ") and line.strip() and not in_list and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            blocks.append(Block(path, i + 1, "indented", "\n".join(r[4:] for r in lines[i:end]), None))
            i = end
            continue
        i += 1
    return blocks


ALL_BLOCKS = [b for path in DOC_FILES for b in parse_blocks(path)]
EXAMPLES = [b for b in ALL_BLOCKS if b.lang in RUNNABLE]


def test_the_docs_have_examples_and_skips_say_why():
    assert len(EXAMPLES) >= 10, [b.where for b in EXAMPLES]
    for block in EXAMPLES:
        if block.skip_reason is not None:
            assert block.skip_reason, f"{block.where}: `doc-test: skip` needs a reason"


def test_no_unfenced_examples():
    unfenced = [
        f"{b.where}: {b.code.strip().splitlines()[0][:80]}"
        for b in ALL_BLOCKS
        if b.lang in ("indented", "") and b.code.strip() and LOOKS_RUNNABLE.match(b.code.strip().splitlines()[0])
    ]
    assert not unfenced, (
        "code blocks that look like examples but are not fenced with sh/bash/python (or marked text):\n"
        + "\n".join(unfenced)
    )


@pytest.fixture
def doc_server(request):
    """The tiny pipelines behind a live server, for examples that call localhost:8000: the
    session's `omnistage serve` of every configs/tiny-*.yaml (tests/conftest.py's tiny_server,
    what `make run` serves), started when the first such example needs it."""
    return lambda: request.getfixturevalue("tiny_server")


def _workdir(tmp_path: Path) -> Path:
    import omnistage

    (tmp_path / "configs").symlink_to(Path(omnistage.__file__).parent / "configs")
    return tmp_path


@pytest.mark.parametrize("block", EXAMPLES, ids=[b.where for b in EXAMPLES])
def test_example_runs(block: Block, tmp_path, doc_server):
    if block.skip_reason is not None:
        pytest.skip(f"{block.where}: {block.skip_reason}")
    code = block.code
    if SERVER_ADDRESS.search(code):
        server = doc_server()
        code = SERVER_ADDRESS.sub(f"127.0.0.1:{server.port}", code)
    workdir = _workdir(tmp_path)
    # curl as the examples call it, but failing (exit 22, body shown) on an HTTP error status
    (workdir / ".curlrc").write_text("fail-with-body\nshow-error\n")
    env = {
        **os.environ,
        "CURL_HOME": str(workdir),
        "PYTHONSAFEPATH": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    if RUNNABLE[block.lang] == "shell":
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        argv = [sys.executable, "-c", code]
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{block.where} failed (exit {proc.returncode}):\n{block.code}\n"
        f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    )
