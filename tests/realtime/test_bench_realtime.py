"""`omnistage bench realtime --quick` against the test server: what it measures is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from omnistage.tests.realtime.conftest import KEY


def test_quick_bench_measures_spoken_sessions(rt_server, tmp_path):
    out = tmp_path / "realtime.json"
    omnistage = Path(sys.executable).parent / "omnistage"
    cmd = [str(omnistage), "bench", "realtime", "--quick", "--sessions", "2", "--no-progress"]
    cmd += ["--url", rt_server.url, "--api-key", KEY, "--json", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONSAFEPATH": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    plan = result["plan"]
    assert plan["sessions"] == [2] and "api_key" not in plan
    for n in plan["sessions"]:
        level = result[f"sessions_{n}"]
        assert level["errors"] == []
        # every session: its turns plus the answer to the interruption, each with audio unless
        # the random talker ended at its first step (then no codec tokens, and a barge-in turn
        # without audio has nothing to interrupt)
        silent = level["answers_without_audio"]
        assert all(s.endswith(", 0 codec tokens") and not s.startswith(("failed", "cancelled")) for s in silent), silent
        assert level["answers"] + len(silent) + level["interruptions_not_spoken"] == n * (plan["turns"] + 1)
        assert level["answers"] >= n * plan["turns"] // 2
        assert level["audio_s_received"] > 0
        # the end of speech is only known after silence_duration_ms of silence
        assert plan["silence_ms"] <= level["v2v_ms_p50"] <= level["v2v_ms_p99"]
        # the server starts each answer at the pause that ends the turn (serving/realtime/early.py)
        assert level["preemptive_used"] >= level["answers"] and level["preemptive_discarded"] >= 0
        assert 0 <= level["bargein_ms_p99"] <= level["bargein_done_ms_p99"] or level["bargein_count"] == 0
        assert level["underrun_ms_total"] >= 0
        assert 0 < level["cached_token_share"] <= 1  # later turns hit the session's earlier blocks
        assert level["v2v_ms_p50_range"][0] <= level["v2v_ms_p50"] <= level["v2v_ms_p50_range"][1]
    assert result["sessions_without_underrun"] in (0, 1, 2)
