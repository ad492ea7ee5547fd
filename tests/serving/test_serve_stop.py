"""SIGTERM to a real `omnistage serve` while its pipeline is still loading: a quick, clean exit."""

import os
import signal
import time

import httpx

from omnistage.tests.runtime.conftest import slow_build_yaml
from omnistage.tests.serving.conftest import cmdline, descendants, process_parents, start_server


def test_sigterm_while_loading_exits_quickly_and_cleanly(tmp_path):
    config = tmp_path / "slow-build.yaml"
    config.write_text(slow_build_yaml(300))
    t_start = time.monotonic()
    server = start_server([str(config)], tmp_path / "server.log")
    proc = server.proc
    try:
        deadline = time.monotonic() + 90
        workers: set[int] = set()
        while time.monotonic() < deadline and proc.poll() is None:
            # a worker is a grandchild (forked by the fork server); once one runs, it is loading
            workers = descendants(proc.pid) - {c for c, p in process_parents().items() if p == proc.pid}
            if workers:
                break
            time.sleep(0.1)
        assert workers, server.log()[-3000:]
        start_s = time.monotonic() - t_start  # server up to a loading worker: the machine's pace now
        ready = httpx.get(f"{server.url}/ready", timeout=10)
        assert ready.status_code == 503
        assert ready.json()["pipelines"]["slow-build"]["stages"] == {"loading": {"ready": False}}
        everything = descendants(proc.pid)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert code == 0, server.log()[-3000:]
    # close() no longer waits for the 300 s build (it used to take 15-40 s; now well under 1 s):
    # 6 s on a quiet machine, or the start-up's own time on a loaded one
    assert took < max(6.0, start_s), f"SIGTERM while loading took {took:.1f}s to exit (start-up {start_s:.1f}s)"
    # the fork server and its resource tracker notice the server's exit on their own
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and set(process_parents()) & everything:
        time.sleep(0.1)
    left = set(process_parents()) & everything
    assert not left, {p: cmdline(p) for p in left}
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"omnistage-{proc.pid}-")]
