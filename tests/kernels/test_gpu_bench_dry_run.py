"""bench/gpu_kernels.py --dry-run: every part of the GPU script runs (CPU, interpreter, toy
shapes) and writes its JSON; its greedy tokens agree with the kernels on and off and with
decode replayed from (CPU stand-ins for) CUDA graphs, and its DiT's output with the fused
adaLN norms with diffusers' own."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_gpu_script_dry_run_writes_json(tmp_path):
    out = tmp_path / "gpu_kernels.json"
    env = dict(os.environ, PYTHONSAFEPATH="1", OMNISTAGE_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "omnistage.bench.gpu_kernels", "--dry-run", "--reps", "50", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] is True
    assert [c["kernel"] for c in result["correctness"] if not c["ok"]] == []
    assert len(result["correctness"]) == 7
    names = [k["kernel"].split()[0] for k in result["kernels"]]
    assert names == [
        "decode_attention", "extend_attention", "add_rms_norm", "rope_qk_inplace", "silu_mul", "store_kv",
        "ada_layer_norm",
    ]  # fmt: skip
    for k in result["kernels"]:
        assert k["triton_ms"] > 0 and k["torch_ms"] > 0 and k["bytes"] > 0
    dit = result["dit"]
    assert dit["fused_norms"] == 1  # one block: its norm1 (the last block's context norm is not adaLN-Zero)
    assert dit["max_abs_diff"] < 1e-4 and dit["forward_ms_fused_norms"] > 0
    assert dit["compile_backend"] == "eager" and dit["compiled_max_abs_diff"] < 1e-4 and dit["forward_ms_compiled"] > 0
    engine = result["engine"]
    assert engine["triton"]["greedy_tokens_equal_torch"] == "2/2"
    assert engine["triton_graphs"]["greedy_tokens_equal_torch"] == "2/2"
    assert engine["triton"]["batch1_decode_step_ms"] > 0 and engine["torch"]["batch_output_tok_s"] > 0
    graphs = engine["triton_graphs"]
    assert graphs["graphs_captured"] >= 1 and graphs["graph_replays"] >= 2 and graphs["batch1_graph_replay_ms"] > 0
    assert result["targets"]["batch1_replay_over_bound"] > 0
