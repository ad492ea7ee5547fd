"""The fork server every stage worker is forked from, and what it imports.

Workers start from multiprocessing's fork server rather than from the caller (which may hold
threads, sockets and a web server) or from a fresh interpreter (seconds of imports each). The
fork server imports the stage kinds in use and their libraries once (stages/preload.py), and
each worker shares those pages copy-on-write.

Its imports take seconds (torch, transformers' modeling code, diffusers). `omnistage serve`
therefore starts it from the pipeline files' raw `kind:` values (`start_for_files`) before it
imports anything heavy itself, so the two processes' imports overlap instead of following
each other. The fork server's module list is fixed when it starts; a pipeline whose kinds it
did not preload still runs, its workers importing the rest themselves.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.spawn as mp_spawn
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from omnistage.runtime.openmp import apply_openmp_defaults

# quiet_preload first: its environment must be set before the libraries read it
BASE_PRELOAD = ["omnistage.runtime.quiet_preload", "torch", "omnistage.runtime.worker", "omnistage.stages.generic"]


def preload_modules(kinds: Iterable[str] | None = None) -> list[str]:
    """What the fork server imports: the base modules, then the stage kinds' (`kinds`, or those
    imported in this process), and last the heap freeze. OMNISTAGE_PRELOAD="mod1,mod2"
    replaces the kinds' part ("" for none)."""
    from omnistage.stages.preload import FREEZE_MODULE, stage_preload_modules

    extra = os.environ.get("OMNISTAGE_PRELOAD")
    mods = stage_preload_modules(kinds) if extra is None else [m.strip() for m in extra.split(",") if m.strip()]
    return BASE_PRELOAD + [m for m in mods if m not in BASE_PRELOAD] + [FREEZE_MODULE]


def mp_context(kinds: Iterable[str] | None = None):
    # Stage workers share the machine's cores: bounded OpenMP spin-waiting (runtime.openmp).
    # The fork server reads it when it imports torch, so it is set first.
    apply_openmp_defaults()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload_modules(kinds))  # only matters before the fork server starts
    return ctx


_start_lock = threading.Lock()


@contextlib.contextmanager
def without_main_reimport():
    """Workers never need the caller's __main__: keep multiprocessing from re-running the
    caller's script in the fork server and in each worker (so a plain script without an
    `if __name__ == "__main__"` guard can build pipelines)."""
    original = mp_spawn.get_preparation_data

    def preparation_data(name):
        data = original(name)
        for key in ("init_main_from_path", "init_main_from_name", "main_path"):
            data.pop(key, None)
        return data

    with _start_lock:
        mp_spawn.get_preparation_data = preparation_data
        try:
            yield
        finally:
            mp_spawn.get_preparation_data = original


def kinds_in_files(paths: Iterable[str | Path], overrides: Iterable[str] = ()) -> list[str] | None:
    """The known stage kinds the pipeline files name, read as plain YAML without validation.
    None when that reading cannot be trusted: a file that is not a regular file (a pipe is read
    once, by the loader), does not parse, names a kind through ${VAR}, or an override that sets
    a kind. The normal start, after validation, then takes over."""
    from omnistage.graph.paths import resolve_pipeline_path
    from omnistage.stages.registry import KIND_MODULES

    if any("kind" in str(o) for o in overrides):  # --set stages.x.kind=..., or a whole stage
        return None
    kinds: list[str] = []
    for path in paths:
        try:
            file = resolve_pipeline_path(path)
            if not file.is_file():
                return None
            from ruamel.yaml import YAML

            stages = YAML(typ="safe", pure=True).load(file.read_text())["stages"]
            named = [stage["kind"] for stage in stages.values()]
        except Exception:  # noqa: BLE001 - only a speed-up: the loader reports what is wrong
            return None
        if not all(isinstance(kind, str) and "${" not in kind for kind in named):
            return None
        kinds += named
    return [kind for kind in dict.fromkeys(kinds) if kind in KIND_MODULES]


def start_for_files(paths: Iterable[str | Path], overrides: Iterable[str] = ()) -> bool:
    """Start the fork server now, preloading the kinds these pipeline files name. Returns
    whether it was started (not when kinds_in_files cannot tell them)."""
    kinds = kinds_in_files(paths, overrides)
    if not kinds:
        return False
    mp_context(kinds)
    with without_main_reimport():
        multiprocessing.forkserver.ensure_running()
    return True
