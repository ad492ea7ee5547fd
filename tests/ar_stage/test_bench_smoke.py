"""`omnistage bench ar --quick` runs end to end and writes the JSON the docs describe."""

import json
import os
import subprocess
import sys

import pytest

from omnistage.bench.plot import SERIES_COLORS


@pytest.mark.timeout(400)
def test_bench_ar_quick(tmp_path, png_colors):
    out, png = tmp_path / "ar.json", tmp_path / "ar.png"
    cmd = ["bench", "ar", "--quick", "--json", str(out), "--concurrency", "1,4,8", "--plot", str(png)]
    proc = subprocess.run(
        [sys.executable, "-m", "omnistage.serving.cli", *cmd],
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["omnistage_mode"] == "pipeline"
    requested = data["workload"]["requested_output_tokens"]
    assert requested >= data["workload"]["requests"] * data["workload"]["output_len_range"][0]
    for system in ("omnistage", "hf_serial", "hf_static", "hf_generate_batch"):
        entry = data["systems"][system]
        assert "error" not in entry, entry
        # the tokens each system really produced in every run, exactly what was asked
        expected = entry["settings"]["requested_output_tokens"] if system == "hf_serial" else requested
        assert entry["output_tokens"]["min"] == entry["output_tokens"]["max"] == expected, system
        for key in ("output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"):
            fig = entry[key]
            assert fig["min"] <= fig["median"] <= fig["max"] and fig["median"] > 0
        assert entry["peak_rss_mb"] > 100
    for key in ("vs_hf_serial", "vs_hf_static", "vs_hf_generate_batch", "prefix_ttft"):
        assert data["ratios"][key] > 0
    # the greedy check compares against transformers generate() in the same run
    assert data["checks"]["greedy_equal_hf"] is True
    checks = data["checks"]
    assert checks["tokens_equal"] is True
    # --quick compares the first 8 tokens of 4 requests (every request asks for at least 8)
    assert data["workload"]["output_len_range"][0] >= 8
    assert (checks["requests"], checks["tokens_compared"]) == (4, 32)
    share = data["prefix_cache"]["cached_prompt_share"]["median"]
    assert 0.5 < share < 1.0  # the shared prefix's whole blocks, never the unique suffix
    assert data["systems"]["hf_generate_batch"]["settings"]["num_blocks"] == 16
    # the concurrency sweep: every level ran the whole workload through the pipeline
    sweep = data["concurrency_sweep"]
    assert sweep["levels"] == [1, 4, 8] and sweep["rounds"] == 1
    for point in sweep["points"]:
        assert point["output_tokens"]["min"] == point["output_tokens"]["max"] == requested
        for key in ("output_tok_s", "ttft_ms_p50", "tpot_ms_p50"):
            assert point[key]["min"] <= point[key]["median"] <= point[key]["max"] and point[key]["median"] > 0
    colors = png_colors(png)
    for system in ("omnistage", "hf_serial", "hf_static", "hf_generate_batch"):
        assert png_colors.rgb(SERIES_COLORS[system]) in colors, system
