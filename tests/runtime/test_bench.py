"""`omnistage bench runtime --quick` runs end to end and reports every figure."""

import json

from omnistage.bench.plot import SERIES_COLORS
from omnistage.bench.plot import main as plot_main
from omnistage.bench.runtime import main


def test_bench_runtime_quick(tmp_path, png_colors):
    out, png = tmp_path / "bench.json", tmp_path / "hops.png"
    assert main(["--quick", "--no-progress", "--json", str(out), "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    for key in ("hop_us_p50", "hop_us_p99", "transfer_gbps", "graph4_overhead_ms_p50"):
        assert result[key] > 0, key
        spread = result["spread"][key]
        assert len(spread["runs"]) >= 3 and spread["min"] <= result[key] <= spread["max"]
    assert result["hop_us_p50"] <= result["hop_us_p99"]
    assert result["reference"]["pipe_hop_us_p50"]["median"] > 0
    assert result["reference"]["producer_copy_and_sum_gbps"]["median"] > 0
    # the histogram's data points are in the JSON, and the PNG draws both series
    assert len(result["samples"]["hop_us"]) == result["settings"]["hops_per_run"] * result["settings"]["runs"]
    assert sorted(result["samples"]["hop_us"])[len(result["samples"]["hop_us"]) // 2] > 0
    # `omnistage bench plot` draws the same figure again from the saved JSON
    redrawn = tmp_path / "hops-again.png"
    assert plot_main([str(out), "-o", str(redrawn)]) == 0
    for path in (png, redrawn):
        colors = png_colors(path)
        for series in ("omnistage", "pipe_hop"):
            assert png_colors.rgb(SERIES_COLORS[series]) in colors, (path.name, series)
