"""Third-party advisory output off in stage workers (and in `omnistage serve`).

transformers, diffusers and huggingface_hub print advisories and progress bars while a
worker builds its engine (diffusers' `accelerate` notice per model, one "Loading weights" bar
per model, transformers' config warnings about a checkpoint's special token ids): several
dozen lines per pipeline start that interleave across workers and say nothing about the
request at hand. The fork server sets these defaults in its own environment when it starts
(runtime/quiet_preload.py), and every worker inherits them; the caller's process is left as it
was. A value in the environment wins (TRANSFORMERS_VERBOSITY=info brings transformers' back),
and OMNISTAGE_QUIET=0 keeps all of it.
"""

from __future__ import annotations

import os

QUIET_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def quiet_environment(environ=os.environ) -> None:
    if environ.get("OMNISTAGE_QUIET", "1") == "0":
        return
    for key, value in QUIET_ENV.items():
        environ.setdefault(key, value)


def quiet_for_log_level(log_level: str) -> None:
    """`omnistage serve`: silence third-party chatter in the serving process too, unless
    --log-level debug, which keeps it everywhere (workers included); a value the user set wins.
    Called before the fork server starts, which inherits this environment."""
    if log_level.lower() == "debug":
        os.environ.setdefault("OMNISTAGE_QUIET", "0")
        return
    quiet_environment()
