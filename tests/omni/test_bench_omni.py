"""`omnistage bench omni --quick` end to end: both systems really produce the fixed lengths
(text tokens, codec tokens, audio = codec tokens x samples per codec token), agree token for
token, and every key the full run reports is there with a finite value."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path


def test_quick_bench_produces_the_fixed_lengths_and_matches_transformers(tmp_path):
    # bench.omni sets OMP_WAIT_POLICY for its own process when imported: keep that out of the
    # test session (later tests' workers compare their environment with it), and run the
    # benchmark in its own process, as a user does.
    prior = os.environ.get("OMP_WAIT_POLICY")
    from omnistage.bench.omni import BenchConfig

    if prior is None:
        os.environ.pop("OMP_WAIT_POLICY", None)

    cfg = BenchConfig.make(quick=True)
    out = tmp_path / "omni.json"
    cli = Path(sys.executable).parent / "omnistage"
    done = subprocess.run([str(cli), "bench", "omni", "--quick", "--json", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    checks = result["checks"]
    samples = cfg.codec_tokens * checks["samples_per_codec_token"]
    assert checks["samples_per_codec_token"] == 2 * 5 * 3 * 2 * 2 * 2 * 2  # DiT repeats x BigVGAN upsampling
    c_max = max(cfg.concurrency)
    runs = [
        *(result["omnistage"][f"c{c}"] for c in cfg.concurrency),
        result["hf"]["serial"],
        result["hf"][f"batch_c{c_max}"],
    ]
    for run in runs:
        assert run["text_tokens"] == [cfg.text_tokens]
        assert run["codec_tokens"] == [cfg.codec_tokens]
        assert run["audio_samples"] == [samples]
        assert run["requests"] in (cfg.requests, cfg.hf_requests, c_max)
    assert (
        checks["greedy_equal_hf"] and all(checks["codes_equal_hf"]) and len(checks["codes_equal_hf"]) == cfg.hf_requests
    )
    assert checks["fixed_lengths"]
    ratios = result["ratios"]
    for key in ("ttfa_vs_hf_full_c1", f"throughput_vs_hf_c{c_max}", f"throughput_vs_hf_batch_c{c_max}"):
        assert math.isfinite(ratios[key]) and ratios[key] > 0
    omni = result["omnistage"]["c1"]
    # streamed: the first audio leaves before the request is over, the first text before that
    assert omni["ttft_p50_s"] < omni["ttfa_p50_s"] < omni["latency_p50_s"]
    assert result["config"]["hf_serial_subset"] == cfg.hf_requests
    # every round measured both systems; each ratio is the median of its rounds, within their range
    assert len(result["rounds"]) == cfg.repeats >= 2
    for key, spread in result["ratio_ranges"].items():
        per_round = [r["ratios"][key] for r in result["rounds"]]
        assert spread["runs"] == per_round and spread["min"] <= spread["median"] <= spread["max"]
        assert ratios[key] == spread["median"] and spread["min"] == min(per_round)


def test_token2wav_bench_quick_counts_real_solves_and_compares_steps(tmp_path, omni_dir):
    """`omnistage bench omni_token2wav --quick`: the stage really decodes (audio length = codes
    x 480 samples, 36 / 12 DiT evaluations per ODE solve counted on the network), the
    reference setting reproduces itself, and 4 ODE steps land near it but not on it."""
    import torch

    from omnistage.bench import omni_token2wav

    threads = torch.get_num_threads()
    out = tmp_path / "t2w.json"
    try:
        assert omni_token2wav.main(["--quick", "--steps", "10,4", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    ref, fewer = result["settings"]["steps_10"], result["settings"]["steps_4"]
    assert ref["samples"] == fewer["samples"] == result["codes"] * 480
    assert (ref["dit_evals_per_ode_solve"], fewer["dit_evals_per_ode_solve"]) == (36, 12)
    assert ref["mel_snr_db_vs_ref"] > 1000 and ref["wave_snr_db_vs_ref"] > 1000
    assert 30 <= fewer["mel_snr_db_vs_ref"] < 100
    assert all(s["rtf"]["median"] > 0 and s["cpu_rtf"]["median"] > 0 for s in (ref, fewer))
