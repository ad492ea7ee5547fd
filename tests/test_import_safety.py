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


def test_every_subpackage_is_listed_for_the_wheel():
    # pyproject lists packages by hand (the root maps to `omnistage`); an editable install finds
    # an unlisted folder anyway, so only this check notices a wheel that would leave it out.
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    skip = {"tests", "configs", "docs", "bench-results", "build", "dist"}
    found = {
        "omnistage." + ".".join(init.parent.relative_to(REPO).parts)
        for init in REPO.rglob("__init__.py")
        if init.parent != REPO and not (set(init.relative_to(REPO).parts) & skip) and ".venv" not in init.parts
    }
    assert found - listed == set()
