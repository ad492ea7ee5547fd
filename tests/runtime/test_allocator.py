"""The worker malloc settings: memory freed by one large temporary is reused by the next
without page faults (counted by the kernel), and the user's settings win."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omnistage.runtime.allocator import apply_allocator_defaults

PROBE = r"""
import json, resource, sys
from omnistage.runtime.allocator import apply_allocator_defaults
applied = apply_allocator_defaults() if sys.argv[1] == "on" else {}
import torch
def churn():
    for _ in range(10):  # like an engine step: a few large temporaries alive together, then freed
        ts = [torch.ones(4 << 20) for _ in range(4)]  # 4 x 16 MiB
        del ts
churn()  # first touches of the heap are counted as faults either way
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}))
"""


def _probe(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "OMNISTAGE_MALLOC_TUNING"}
    if mode == "off":
        # glibc's starting threshold, pinned: its dynamic raise depends on the order of earlier
        # frees, so the unpinned default faults in some runs and not in others
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_memory_is_reused_without_page_faults():
    off, on = _probe("off"), _probe("on")
    assert on["applied"]["mmap_threshold"] == 32 << 20
    # fresh mappings give the 64 MiB back after each round and fault it in again (4096 pages
    # per 16 MiB block); with the settings the heap keeps it
    assert off["faults"] > 10 * 4 * 2000
    assert on["faults"] < 2000


def test_user_settings_and_opt_out_win():
    assert apply_allocator_defaults({"MALLOC_TRIM_THRESHOLD_": "1000"}) == {}
    assert apply_allocator_defaults({"OMNISTAGE_MALLOC_TUNING": "0"}) == {}
