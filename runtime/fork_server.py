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


def kinds_in_files(paths: Iterable[str | Path]) -> list[str] | None:
    """The known stage kinds the pipeline files name, read as plain YAML without validation;
    None when a file does not read that way (the normal start, after validation, takes over)."""
    import yaml

    from omnistage.graph.paths import resolve_pipeline_path
    from omnistage.stages.registry import KIND_MODULES

    kinds: list[str] = []
    for path in paths:
        try:
            stages = yaml.safe_load(resolve_pipeline_path(path).read_text())["stages"]
            kinds += [stage["kind"] for stage in stages.values()]
        except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, AttributeError):
            return None
    return [kind for kind in dict.fromkeys(kinds) if kind in KIND_MODULES]


def start_for_files(paths: Iterable[str | Path]) -> bool:
    """Start the fork server now, preloading the kinds these pipeline files name. Returns
    whether it was started (not when a file cannot be read as plain YAML)."""
    kinds = kinds_in_files(paths)
    if not kinds:
        return False
    mp_context(kinds)
    with without_main_reimport():
        multiprocessing.forkserver.ensure_running()
    return True
