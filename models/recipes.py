"""Built-in tiny random-weight checkpoints, built locally with a fixed seed on first use.

A recipe is a function `build(out_dir: Path) -> None` that writes a real Hugging Face /
diffusers layout (save_pretrained, locally built tokenizer). `resolve_model` turns a
ModelRef into a local directory: `tiny:<name>` builds (once, under a file lock, cached in
$OMNISTAGE_CACHE or ~/.cache/omnistage), a local path is used as is, and a hub id is looked
up in the local Hugging Face cache only (nothing is downloaded at run time).

Recipe modules register themselves; RECIPE_MODULES lists them so a name resolves without
importing every recipe up front.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from omnistage.errors import InvalidRequestError

RecipeBuilder = Callable[[Path], None]

# recipe name -> module that registers it. Add a line when you add a recipe.
RECIPE_MODULES: dict[str, str] = {
    "tiny-llm": "omnistage.models.tiny_llm",
    "tiny-sd3": "omnistage.models.tiny_diffusion",
    "tiny-flux": "omnistage.models.tiny_diffusion",
    "tiny-wan": "omnistage.models.tiny_wan",
    "qwen2_5_omni": "omnistage.models.tiny_omni",
    "qwen2_5_omni-gqa": "omnistage.models.tiny_omni",
}

_RECIPES: dict[str, tuple[RecipeBuilder, str]] = {}


def register_recipe(name: str, version: str = "1", module: str | None = None):
    """Register `build(out_dir)` as tiny recipe `name`. Bump `version` when its output changes."""

    def deco(fn: RecipeBuilder) -> RecipeBuilder:
        _RECIPES[name] = (fn, version)
        return fn

    return deco


def cache_root() -> Path:
    return Path(os.environ.get("OMNISTAGE_CACHE", Path.home() / ".cache" / "omnistage"))


def known_recipes() -> list[str]:
    return sorted(set(RECIPE_MODULES) | set(_RECIPES))


def _lookup(name: str) -> tuple[RecipeBuilder, str]:
    if name not in _RECIPES and name in RECIPE_MODULES:
        importlib.import_module(RECIPE_MODULES[name])
    if name not in _RECIPES:
        raise InvalidRequestError(f"unknown tiny recipe {name!r}; known: {', '.join(known_recipes()) or 'none'}")
    return _RECIPES[name]


def build_recipe(name: str) -> Path:
    """Directory of tiny recipe `name`, building it first if needed (process-safe)."""
    builder, version = _lookup(name)
    root = cache_root() / "tiny"
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{name}-v{version}"
    done_marker = target / ".complete"
    if done_marker.exists():
        return target
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done_marker.exists():
            return target
        tmp = root / f".{name}-v{version}.building-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        t0 = time.time()
        print(f"omnistage: building tiny checkpoint {name!r} in {target} ...", file=sys.stderr)
        builder(tmp)
        (tmp / ".complete").write_text(f"built in {time.time() - t0:.1f}s\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        print(f"omnistage: built {name!r} in {time.time() - t0:.1f}s", file=sys.stderr)
    return target


def resolve_model(source: str, subfolder: str | None = None) -> Path:
    """Local directory (or file) for a model source string."""
    if source.startswith("tiny:"):
        path = build_recipe(source[len("tiny:") :])
    else:
        path = Path(os.path.expanduser(source))
        if not path.exists():
            path = _from_hub_cache(source)
    if subfolder:
        path = path / subfolder
        if not path.exists():
            raise InvalidRequestError(f"model {source!r} has no subfolder {subfolder!r}")
    return path


def _from_hub_cache(repo_id: str) -> Path:
    if repo_id.count("/") != 1:
        raise InvalidRequestError(f"model {repo_id!r}: no such local path, and not a hub id")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - any miss means "not available offline"
        raise InvalidRequestError(
            f"model {repo_id!r} is not in the local Hugging Face cache and nothing is "
            f"downloaded at run time; download it first or give a local path ({exc.__class__.__name__})"
        ) from None
