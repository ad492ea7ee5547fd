"""`omnistage bench jobs` smoke run: a few jobs through every phase (python, jobs, crash) and the
JSON it reports; the figures themselves are checked by the benchmark on a quiet machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_jobs_quick_reports_every_figure(tmp_path):
    out = tmp_path / "jobs.json"
    exe = Path(sys.executable).parent / "omnistage"
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    done = subprocess.run(
        [str(exe), "bench", "jobs", "--quick", "--jobs", "12", "--json", str(out)],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["jobs"] == 12 and result["runs_count"] == 1 and result["failed_jobs"] == 0
    assert 0 < result["submit_ms_p50"] <= result["submit_ms_p99"]
    assert result["webhook_ms_p50"] is not None and result["webhook_ms_p50"] > 0  # every job's webhook arrived
    rates = result["throughput"]
    assert rates["python_jobs_per_s"] > 0 and rates["jobs_per_s"] > 0
    ratio = result["ratios"]["jobs_vs_python_throughput"]
    assert abs(ratio - rates["jobs_per_s"] / rates["python_jobs_per_s"]) < 0.01
    assert set(result["runs"]["submit_ms_p99"]) == {"median", "min", "max"}
    # the crash phase: a kill -9 mid-run, a restart, every job resubmitted under its key
    crash = result["crash"]
    assert crash["lost_jobs"] == 0 and crash["duplicate_jobs"] == 0 and crash["lost_webhook_events"] == 0
