"""Every kernel compiles to a cubin for sm_90 (the GPU script's target) on this CPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cached one
    env["PYTHONSAFEPATH"] = "1"
    script = Path(__file__).with_name("sm90_compile.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 14, proc.stdout
