"""Where pipeline files are: the package's configs/ and bare names resolved there.

Kept free of heavy imports so that a command can find its files before it imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path


def package_configs_dir() -> Path:
    import omnistage

    return Path(omnistage.__file__).parent / "configs"


def resolve_pipeline_path(path_or_name: str | os.PathLike) -> Path:
    """A bare name (no slash, no .yaml/.yml suffix) is looked up in the package's configs/."""
    text = os.fspath(path_or_name)
    is_bare = "/" not in text and os.sep not in text and not text.endswith((".yaml", ".yml"))
    if is_bare:
        return package_configs_dir() / f"{text}.yaml"
    return Path(text)


def default_config_paths() -> list[Path]:
    """Every configs/tiny-*.yaml shipped in the package (what `omnistage serve` serves by default)."""
    return sorted(package_configs_dir().glob("tiny-*.yaml"))
