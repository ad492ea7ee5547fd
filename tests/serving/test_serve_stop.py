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
    # close() no longer waits for the 300 s build (it used to take 15-40 s; now well under 1 s)
    assert took < 6, f"SIGTERM while loading took {took:.1f}s to exit"
    # the fork server and its resource tracker notice the server's exit on their own
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and set(process_parents()) & everything:
        time.sleep(0.1)
    left = set(process_parents()) & everything
    assert not left, {p: cmdline(p) for p in left}
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"omnistage-{proc.pid}-")]
