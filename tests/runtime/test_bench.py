"""`omnistage bench runtime --quick` runs end to end and reports every figure."""

import json
import zlib

import torch

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
    # every transfer (warm-ups included) carried its own tensor, checked at the far end: the
    # CRC-32s, recomputed here from the producer's definition (seeded randn, nonce in element 0)
    settings = result["settings"]
    checks = result["transfer_checksums"]
    assert [c["nonce"] for c in checks] == list(range(1, settings["runs"] * (settings["transfers_per_run"] + 1) + 1))
    source = torch.randn(settings["tensor_mib"] * 2**20 // 4, generator=torch.Generator().manual_seed(0))
    for c in (checks[0], checks[-1]):
        source[0] = float(c["nonce"])
        assert c["crc32"] == zlib.crc32(source.numpy().tobytes()), c
    assert len({c["crc32"] for c in checks}) == len(checks)
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
