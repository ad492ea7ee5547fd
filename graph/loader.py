"""Load a pipeline YAML file into a validated PipelineSpec.

    spec = load_pipeline("configs/tiny-llm.yaml", overrides=["stages.llm.pool.threads=2"])
    spec = load_pipeline("tiny-llm")        # a bare name: <package>/configs/tiny-llm.yaml

Order: parse (positions kept) -> `${VAR:-default}` interpolation -> `--set` overrides ->
validation. Every problem is collected and raised together as PipelineValidationError,
each line `FILE:LINE:COL: message`.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path

from omnistage.graph.interpolate import interpolate
from omnistage.graph.nodes import Problem, parse_yaml
from omnistage.graph.overrides import apply_overrides
from omnistage.graph.paths import package_configs_dir, resolve_pipeline_path
from omnistage.graph.spec import PipelineSpec, SourcePos
from omnistage.graph.validate import build_spec


class PipelineValidationError(Exception):
    """A pipeline file with problems; `.problems` holds every `FILE:LINE:COL: message` line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def _missing_file_hint(path: Path) -> str:
    """What to load instead: the packaged pipelines for a bare name; for a relative path such
    as configs/tiny-llm.yaml (the docs' examples, written from the checkout), the packaged
    file it names."""
    configs = package_configs_dir()
    if path.parent == configs:
        names = sorted(p.stem for p in configs.glob("*.yaml"))
        close = difflib.get_close_matches(path.stem, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{hint}; pipelines under configs/: {', '.join(names) or 'none'}"
    parts = path.parts
    hub_like = len(parts) == 2 and path.suffix not in (".yaml", ".yml") and not path.parent.exists()
    if hub_like:  # org/model: a Hugging Face id
        return (
            f"; omnistage serves pipeline files, and a model goes in a stage's `model:` (e.g. a copy of "
            f"{configs / 'tiny-llm.yaml'} whose llm stage has `model: {path}`, read from the local "
            "Hugging Face cache; docs/pipelines.md)"
        )
    if not path.is_absolute() and "configs" in parts:
        packaged = configs.joinpath(*parts[parts.index("configs") + 1 :])
        if packaged.is_file():
            by_name = f"the name {packaged.stem!r} or " if packaged.parent == configs else ""
            return f" in {Path.cwd()}; the package has it: {by_name}{packaged}"
    return ""


def load_pipeline(
    path_or_name: str | os.PathLike,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    environ: Mapping[str, str] | None = None,
) -> PipelineSpec:
    path = resolve_pipeline_path(path_or_name)
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PipelineValidationError([f"{file}:1:1: no such pipeline file{_missing_file_hint(path)}"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PipelineValidationError([f"{file}:1:1: cannot read the file: {exc}"]) from None
    return load_pipeline_text(text, file, overrides, source=path.resolve(), environ=environ)


def load_pipeline_text(
    text: str,
    file: str = "<string>",
    overrides: list[str] | tuple[str, ...] = (),
    *,
    source: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> PipelineSpec:
    """Same as load_pipeline for YAML text already in memory (`file` names it in messages)."""
    root, problems = parse_yaml(text, file)
    if root is not None:
        root = interpolate(root, os.environ if environ is None else environ, problems)
        apply_overrides(root, list(overrides), problems)
        spec = build_spec(root, file, source, problems)
    else:
        spec = None
    if problems or spec is None:
        raise PipelineValidationError(_sorted_lines(problems, file))
    return spec


def _sorted_lines(problems: list[Problem], main_file: str) -> list[str]:
    def key(p: Problem) -> tuple:
        return (p.pos.file != main_file, p.pos.file, p.pos.line, p.pos.col)

    lines: list[str] = []
    for problem in sorted(problems, key=key):
        line = str(problem)
        if line not in lines:
            lines.append(line)
    return lines or [str(Problem(SourcePos(main_file, 1, 1), "invalid pipeline"))]
