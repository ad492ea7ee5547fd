"""`omnistage bench plot` refuses results it cannot draw with a clear message, not a traceback."""

import json
import os
import subprocess
import sys


def _plot(tmp_path, result) -> subprocess.CompletedProcess:
    src = tmp_path / "result.json"
    src.write_text(result if isinstance(result, str) else json.dumps(result))
    return subprocess.run(
        [sys.executable, "-m", "omnistage.serving.cli", "bench", "plot", str(src), "-o", str(tmp_path / "out.png")],
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ar_result_without_a_sweep_names_the_option(tmp_path):
    proc = _plot(tmp_path, {"bench": "ar", "systems": {}, "ratios": {}})
    assert proc.returncode == 2
    assert "--concurrency" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out.png").exists()


def test_unknown_json_and_broken_json_are_refused(tmp_path):
    for result in ({"some": "thing"}, "{not json"):
        proc = _plot(tmp_path, result)
        assert proc.returncode == 2, proc.stderr
        assert "result.json" in proc.stderr and "Traceback" not in proc.stderr
