"""SIGTERM to a real `omnistage serve` while its pipeline is still loading: a quick, clean exit."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SLOW_BUILD_YAML = """
name: slow-build
inputs: {x: tensor}
outputs: {y: tensor}
stages:
  loading:
    kind: torch_module
    params:
      factory: omnistage.runtime.testmodules:SlowToBuild
      kwargs: {build_s: 300}
      inputs: {x: tensor}
      outputs: {y: tensor}
    batching: {policy: none}
edges:
  - {from: inputs.x, to: loading.x}
  - {from: loading.y, to: outputs.y}
"""


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if fields[0] != "Z":
                out[int(entry)] = int(fields[1])
    return out


def _descendants(pid: int) -> set[int]:
    parents, found, frontier = _parents(), set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


def test_sigterm_while_loading_exits_quickly_and_cleanly(tmp_path):
    config = tmp_path / "slow-build.yaml"
    config.write_text(SLOW_BUILD_YAML)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "omnistage"), "serve", str(config), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONSAFEPATH": "1"})
    try:
        deadline = time.monotonic() + 90
        workers: set[int] = set()
        while time.monotonic() < deadline and proc.poll() is None:
            # a worker is a grandchild (forked by the fork server); once one runs, it is loading
            workers = _descendants(proc.pid) - {c for c, p in _parents().items() if p == proc.pid}
            if workers:
                break
            time.sleep(0.1)
        assert workers, (tmp_path / "server.log").read_text()[-3000:]
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=10)
        assert ready.status_code == 503
        assert ready.json()["pipelines"]["slow-build"]["stages"] == {"loading": {"ready": False}}
        everything = _descendants(proc.pid)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    assert code == 0, (tmp_path / "server.log").read_text()[-3000:]
    # close() no longer waits for the 300 s build (it used to take 15-40 s; now well under 1 s)
    assert took < 6, f"SIGTERM while loading took {took:.1f}s to exit"
    # the fork server and its resource tracker notice the server's exit on their own
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and set(_parents()) & everything:
        time.sleep(0.1)
    left = set(_parents()) & everything
    assert not left, {p: Path(f"/proc/{p}/cmdline").read_bytes()[:150] for p in left}
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"omnistage-{proc.pid}-")]
