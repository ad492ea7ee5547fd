"""Fused float32 CPU kernels (kernels/csrc/cpu_fused.cpp for the AR decoder, token2wav_fused.cpp
and token2wav_dit_layer.cpp for the token2wav stage), compiled once per machine.

    ops = cpu_fused.load()          # the extension module, or None (no compiler, disabled, ...)
    if ops is not None:
        out = ops.rms_norm(x, weight, eps)

The first load compiles the source with torch's C++ extension builder (once, tens of seconds,
into ~/.cache/omnistage/kernels/, which `make install` does ahead of time); later loads import
the built module. Any failure is logged once and load() returns None, so callers keep their
eager-op path. OMNISTAGE_CPU_FUSED=0 disables the kernels.

`python -m omnistage.kernels.cpu_fused` builds (or finds) the module and says which.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger("omnistage.kernels")

NAME = "omnistage_cpu_fused"
_CSRC = Path(__file__).with_name("csrc")
SOURCES = [_CSRC / name for name in ("cpu_fused.cpp", "token2wav_fused.cpp", "token2wav_dit_layer.cpp")]
HEADERS = [_CSRC / "t2w_simd.h"]
# -ffp-contract=off: no fused multiply-adds, so products and sums round as the eager ops do.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp-simd"]

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def enabled() -> bool:
    return os.environ.get("OMNISTAGE_CPU_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")


def _cpu_identity() -> bytes:
    """-march=native code runs only on CPUs like the one that built it (a shared home directory
    may serve several machines): the CPU's model and feature flags are part of the cache key."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines).encode()
    except OSError:
        return platform.machine().encode()


def build_dir() -> Path:
    import torch

    key = hashlib.sha256(
        b"".join(s.read_bytes() for s in SOURCES + HEADERS)
        + " ".join(CFLAGS).encode()
        + torch.__version__.encode()
        + _cpu_identity()
    )
    root = Path(os.environ.get("OMNISTAGE_KERNEL_CACHE", Path.home() / ".cache" / "omnistage" / "kernels"))
    return root / f"cpu_fused-{key.hexdigest()[:16]}"


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled module, building it on first use; None when unavailable or disabled."""
    global _module, _tried
    if _tried or not enabled():
        return _module
    with _lock:
        if _tried:
            return _module
        try:
            _module = _load(verbose)
            _follow_torch_sum(_module)
        except Exception as exc:  # noqa: BLE001 - any build problem means: use the eager ops
            log.warning(
                "omnistage: fused CPU kernels unavailable, using eager ops (%s: %s)",
                type(exc).__name__,
                str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
            )
            _module = None
        _tried = True
        return _module


def _load(verbose: bool) -> ModuleType:
    import torch  # noqa: F401 - the module links against the libraries torch loads

    where = build_dir()
    built, ready = where / f"{NAME}.so", where / "ready"
    if ready.exists():
        # the directory name hashes source, flags, torch version and CPU: a module there is current
        # ("ready" is written once a build has finished, so a half-linked file is never loaded)
        spec = importlib.util.spec_from_file_location(NAME, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    from torch.utils import cpp_extension

    where.mkdir(parents=True, exist_ok=True)
    print(f"omnistage: building fused CPU kernels in {where} (once per machine, ~30 s)...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    # the build directory holds a lock file, so concurrent workers wait for one build
    module = cpp_extension.load(
        name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS, build_directory=str(where), verbose=verbose
    )
    print(f"omnistage: fused CPU kernels built in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    tmp = where / f"ready.{os.getpid()}"
    tmp.write_text(str(built))
    tmp.replace(ready)
    return module


def _follow_torch_sum(module: ModuleType) -> None:
    """Set the vector width RMSNorm's sum of squares follows to the one that makes the fused
    norm bit-identical to transformers' eager one on this machine (ATen's float sum adds in
    an order that depends on it)."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, generator=g) * 3 for n in (5, 40, 100, 896, 1000, 3584)]

    def exact() -> bool:
        for x in rows:
            w = torch.randn(x.numel(), generator=g)
            want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
            if not torch.equal(module.rms_norm(x.view(1, -1), w, 1e-6)[0], want):
                return False
        return True

    for lanes in (8, 16):
        module.set_sum_lanes(lanes)
        if exact():
            return
    module.set_sum_lanes(8)
    log.warning("omnistage: the fused RMSNorm rounds unlike torch's on this machine (greedy outputs may differ)")


def _reset_for_tests() -> None:
    global _module, _tried
    with _lock:
        _module, _tried = None, False


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    mod = load(verbose="-v" in sys.argv)
    print(f"fused CPU kernels: {'ready: ' + mod.__file__ if mod is not None else 'unavailable (eager ops)'}")
