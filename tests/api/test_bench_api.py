"""`omnistage bench api --quick` runs both systems on the same requests, in turns, and writes
its JSON: per repeat, and the median (min, max) over the repeats."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest


def _quick_bench(tmp_path: Path, *args: str) -> dict:
    """`omnistage bench api --quick ARGS`, its JSON."""
    out = tmp_path / "api.json"
    omnistage = Path(sys.executable).parent / "omnistage"
    proc = subprocess.run(
        [str(omnistage), "bench", "api", "--quick", *args, "--no-progress", "--json", str(out)],
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_quick_bench_writes_both_systems(tmp_path):
    result = _quick_bench(tmp_path, "--repeats", "2")
    assert len(result["runs"]) == result["plan"]["repeats"] == 2
    for run in result["runs"]:
        python, http = run["python"], run["http"]
        assert set(python) == set(http) == {"c1", "c4"}
        for level in ("c1", "c4"):
            # ignore_eos: every request makes exactly max_tokens tokens, through either door
            expected = python[level]["requests"] * result["plan"]["max_tokens"]
            assert python[level]["tokens"] == http[level]["tokens"] == expected
            assert 0 < http[level]["ttft_ms_p50"] <= http[level]["ttft_ms_p99"]
            # every process that worked shows CPU time (the server's stage workers found too)
            assert set(python[level]["cpu_us_per_token"]) == {"caller", "stage_workers"}
            assert set(http[level]["cpu_us_per_token"]) == {"client", "server", "stage_workers"}
            assert all(us > 0 for us in http[level]["cpu_us_per_token"].values()), http[level]
            assert all(us > 0 for us in python[level]["cpu_us_per_token"].values()), python[level]
        figures = run["figures"]
        assert figures["http_vs_python_throughput_c64"] == http["c4"]["tokens_per_s"] / python["c4"]["tokens_per_s"]
        assert figures["ttft_p50_c1"] == http["c1"]["ttft_ms_p50"] - python["c1"]["ttft_ms_p50"]
    assert len(result["load_average"]["start"]) == len(result["load_average"]["end"]) == 3
    for key, reported in (
        ("http_vs_python_throughput_c64", result["ratios"]["http_vs_python_throughput_c64"]),
        ("ttft_p50_c1", result["http_overhead_ms"]["ttft_p50_c1"]),
    ):
        values = [run["figures"][key] for run in result["runs"]]
        spread = result["spread"][key]
        assert reported == spread["median"] == statistics.median(values)
        assert (spread["min"], spread["max"]) == (min(values), max(values))


def test_quick_bench_with_the_processes_placed(tmp_path):
    """--server-cpus / --worker-cpus / --client-cpus: both systems answer in full, and every
    process ran on the CPUs it was given, as the OS reports them."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two CPUs")
    result = _quick_bench(tmp_path, "--server-cpus", "0", "--worker-cpus", "1", "--client-cpus", "0")
    assert result["placement"] == {"server_cpus": "0", "worker_cpus": "1", "client_cpus": "0"}
    assert result["cpus"] == {"client": [0], "server": [0], "python_workers": [[1]], "server_workers": [[1]]}
    run = result["runs"][0]
    expected = run["python"]["c4"]["requests"] * result["plan"]["max_tokens"]
    assert run["python"]["c4"]["tokens"] == run["http"]["c4"]["tokens"] == expected


def test_a_pinned_client_leaves_the_other_processes_every_cpu(tmp_path):
    """--client-cpus alone narrows only the client: the server and the workers of both systems
    (which would otherwise inherit its affinity) keep every CPU."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two CPUs")
    everything = sorted(os.sched_getaffinity(0))
    result = _quick_bench(tmp_path, "--client-cpus", "1")
    assert result["cpus"]["client"] == [1]
    assert result["cpus"]["server"] == everything
    assert result["cpus"]["python_workers"] == result["cpus"]["server_workers"] == [everything]
