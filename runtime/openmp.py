"""How torch's OpenMP threads wait for each other between ops, for every process omnistage starts.

Between two parallel ops a thread either spins or sleeps. Spinning without bound steals the
core another stage (or tenant) needs. Sleeping at once (`OMP_WAIT_POLICY=PASSIVE`) pays a
futex wake-up on every op instead. A bounded spin keeps back-to-back ops fast and idles soon
after the work stops (docs/runtime.md, "CPU settings", has the figures). Settings already in
the environment win.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULT_SPINCOUNT = "30000"  # libgomp (the OpenMP runtime of the torch wheels)
_USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The wait settings a new process should get: the user's, else the bounded spin."""
    env = os.environ if environ is None else environ
    given = {k: env[k] for k in _USER_KEYS if env.get(k)}
    return given or {"GOMP_SPINCOUNT": DEFAULT_SPINCOUNT}


def apply_openmp_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """Put the settings into `environ` (os.environ by default) before torch is imported there."""
    env = os.environ if environ is None else environ
    env.update(openmp_env(env))
