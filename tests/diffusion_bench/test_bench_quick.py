"""`omnistage bench diffusion --quick --json FILE` runs end to end and writes the documented keys."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from omnistage.bench.plot import SERIES_COLORS


def test_quick_bench_writes_the_json_keys(tmp_path, png_colors):
    out, png = tmp_path / "bench.json", tmp_path / "cdf.png"
    env = dict(os.environ, PYTHONSAFEPATH="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omnistage.serving.cli",
            "bench",
            "diffusion",
            "--quick",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    for key in (
        "throughput_vs_serial",
        "throughput_vs_ideal",
        "p50_latency_vs_serial",
        "p50_latency_vs_request_batching",
        "p99_latency_vs_serial",
    ):
        assert isinstance(data["ratios"][key], float) and data["ratios"][key] > 0
    for system in ("serial", "request_batching", "omnistage"):
        for key in ("latency_ms_p50", "latency_ms_p99", "queue_wait_ms_mean"):
            assert data[system][key]["median"] > 0
    assert data["omnistage"]["step_ms_p50"]["median"] > 0
    # the 4-request equality check against diffusers ran and passed (same seeds, 1e-3)
    assert data["checks"]["equal_diffusers"] is True
    assert data["config"]["denoiser"]["num_layers"] == 4 and data["config"]["quick"] is True
    assert {"met", "value", "target"} <= set(data["targets"]["throughput_vs_serial"])
    # the CDF's data points: one latency per request of each trace, for every system
    for trace in data["mixed"]["traces"]:
        assert len(trace["sizes"]) == data["config"]["mixed"]["requests"]
        for system in ("serial", "request_batching", "omnistage"):
            latencies = trace["latencies_ms"][system]
            assert len(latencies) == len(trace["sizes"]) and min(latencies) > 0
            assert statistics.median(latencies) == pytest.approx(trace[system]["latency_ms_p50"])
    colors = png_colors(png)
    for system in ("serial", "request_batching", "omnistage"):
        assert png_colors.rgb(SERIES_COLORS[system]) in colors, system


def test_serial_service_time_excludes_queueing():
    """Capacity is 1 / mean service time: a request that queued behind another must count only
    its own service (the latency would count the wait too and understate the capacity)."""
    # (bench.diffusion itself sets OMP_WAIT_POLICY for its own process when imported)
    from omnistage.bench.diffusion_baselines import RequestRecord, RunResult, service_times

    t0 = 100.0
    records = [
        RequestRecord(0, t0, finish=t0 + 2.0),
        RequestRecord(1, t0, finish=t0 + 3.0),
        RequestRecord(2, t0 + 10.0, finish=t0 + 10.5),
    ]  # arrived after the pipeline went idle
    assert service_times(RunResult(records, 10.5)) == [2.0, 1.0, 0.5]
