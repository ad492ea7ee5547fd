"""glibc malloc settings for worker processes: keep freed memory for reuse instead of returning it.

An engine step makes and drops many multi-MB temporaries (projection outputs, logits,
attention scratch). glibc serves each from a fresh mmap (or trims it off the heap top) and
gives it back on free, so the next step pays a page fault per 4 KiB page again. On a VM
with free page reporting, pages given back are also handed to the host, and faulting them in
again costs more still. Keeping freed memory in the heap avoids both (docs/runtime.md,
"CPU settings", has the figures).

Settings already in the environment (glibc's MALLOC_*_ variables) win, and
OMNISTAGE_MALLOC_TUNING=0 turns this off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's maximum: blocks up to 32 MiB come from the reusable heap
TRIM_THRESHOLD = 512 << 20  # free memory kept at the heap top before any is returned
TOP_PAD = 64 << 20  # heap growth in steps of at least this much
_USER_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def apply_allocator_defaults(environ: dict[str, str] | None = None) -> dict[str, int]:
    """Set the thresholds in this process (call it early, in the process that will allocate).
    Returns what was applied ({} when skipped: not glibc Linux, turned off, or set by the user)."""
    env = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or env.get("OMNISTAGE_MALLOC_TUNING", "1") == "0":
        return {}
    if any(env.get(k) for k in _USER_KEYS):
        return {}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return {}
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = {}
    for name, param, value in (
        ("mmap_threshold", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        ("trim_threshold", M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        ("top_pad", M_TOP_PAD, TOP_PAD),
    ):
        if mallopt(param, value) == 1:
            applied[name] = value
    return applied
