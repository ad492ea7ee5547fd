"""The repo root must never shadow real packages: transformers probes for `kernels`."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_repo_root_not_on_sys_path():
    roots = {Path(p).resolve() for p in sys.path if p}
    assert REPO not in roots, "the repository root is on sys.path; run with PYTHONSAFEPATH=1"


def test_transformers_and_diffusers_import_as_the_suite_runs():
    import diffusers  # noqa: F401
    import transformers  # noqa: F401

    import omnistage.kernels as ok

    assert Path(ok.__file__).resolve().parent == REPO / "kernels"
    # `kernels` as a top-level name must not resolve to our folder.
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin or "").resolve().parent != REPO / "kernels"


def test_cli_process_imports_cleanly_from_repo_root():
    # The CLI entry point, started from the repo root as `make run` does.
    out = subprocess.run(
        [sys.executable, "-c", "import transformers, diffusers, omnistage, sys; print(sys.path)"],
        cwd=REPO,
        env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert str(REPO) + "'" not in out.stdout and "''" not in out.stdout
