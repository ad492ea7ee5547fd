"""`omnistage bench runtime --quick` runs end to end and reports every figure."""

import json

from omnistage.bench.runtime import main


def test_bench_runtime_quick(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--no-progress", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("hop_us_p50", "hop_us_p99", "transfer_gbps", "graph4_overhead_ms_p50"):
        assert result[key] > 0, key
        spread = result["spread"][key]
        assert len(spread["runs"]) >= 3 and spread["min"] <= result[key] <= spread["max"]
    assert result["hop_us_p50"] <= result["hop_us_p99"]
    assert result["reference"]["pipe_hop_us_p50"]["median"] > 0
    assert result["reference"]["producer_copy_and_sum_gbps"]["median"] > 0
