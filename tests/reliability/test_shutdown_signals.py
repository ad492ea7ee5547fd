"""What Ctrl+C in a terminal or a service manager's stop does: a signal delivered to every
process of the group at once (os.killpg), while requests run. Nothing may stay behind: no
process of the group, no /dev/shm/omnistage-* file. After a SIGKILL of the whole group (no
one cleans up), the next pipeline start removes the files whose owner is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from omnistage.runtime.pipeline import Pipeline
from omnistage.tests.serving.conftest import OMNISTAGE, cmdline, descendants, free_port

LOOP = Path(__file__).with_name("pipeline_loop.py")


def owned_segments(pid: int) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"omnistage-{pid}-")]


def stop_group(proc: subprocess.Popen, sig: int, log: Path | None = None) -> tuple[set[int], float]:
    """Signal the whole process group at once; wait for the leader; return the group's other
    processes as they were and how long the leader took to exit. A leader that hangs and
    writes to `log` with faulthandler on SIGUSR1 has its threads' stacks in the failure."""
    group = descendants(proc.pid)
    t0 = time.monotonic()
    os.killpg(proc.pid, sig)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        stacks = ""
        if log is not None:
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)
            stacks = "\n" + log.read_text(errors="replace")[-6000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise AssertionError(
            f"{signal.Signals(sig).name} to the group: the leader did not exit within 60 s{stacks}"
        ) from None
    return group, time.monotonic() - t0


def running(pid: int) -> bool:
    """The process exists and has not exited. A zombie has exited: reaping an orphan is the
    init process's job, and a container's init may never do it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_gone(group: set[int], timeout: float = 15) -> list[int]:
    """The processes of `group` still running after up to `timeout` seconds (a SIGKILLed
    process with much memory takes a moment to be torn down)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(running(p) for p in group):
        time.sleep(0.1)
    return [p for p in group if running(p)]


def assert_nothing_left(pid: int, group: set[int]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (owned_segments(pid) or any(running(p) for p in group)):
        time.sleep(0.1)
    left = {p: cmdline(p) for p in group if running(p)}
    assert not left, left
    assert not owned_segments(pid), owned_segments(pid)


def start_group(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMNISTAGE_JOBS_DIR": str(log.parent / "jobs")}
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_python_api_program_stopped_by_group_signal_leaves_nothing(tmp_path, sig):
    log = tmp_path / "loop.log"
    proc = start_group([sys.executable, str(LOOP), "tiny-diamond"], log)
    try:
        deadline = time.monotonic() + 180
        while "READY" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        assert owned_segments(proc.pid), "the program made no shared-memory segment to leave behind"
        group, _ = stop_group(proc, sig, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert group
    assert_nothing_left(proc.pid, group)


def test_server_stopped_by_group_sigterm_mid_request_leaves_nothing(tmp_path):
    sig = signal.SIGTERM  # SIGINT takes the same path in the server (uvicorn's handler)
    port = free_port()
    proc = start_group(
        [str(OMNISTAGE), "serve", "tiny-image", "--port", str(port), "--drain-timeout", "3"], tmp_path / "serve.log"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        body = {"model": "tiny-image", "prompt": "a red square", "size": "64x64", "response_format": "b64_json"}
        assert httpx.post(f"{url}/v1/images/generations", json=body, timeout=120).status_code == 200
        # requests in flight when the signal lands: denoiser state and shared segments live
        client = httpx.Client(timeout=120)
        threads = [
            threading.Thread(target=_post_quietly, args=(client, f"{url}/v1/images/generations", body), daemon=True)
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        time.sleep(0.3)
        group, took = stop_group(proc, sig)
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert group and took < 45, took
    assert_nothing_left(proc.pid, group)
    # the fork server got the signal too: it must not take the workers' exit statuses down
    # with it (the hub would read every worker as dead and restart them during the drain)
    log = (tmp_path / "serve.log").read_text()
    assert " died (" not in log, log[-3000:]


def _post_quietly(client: httpx.Client, url: str, body: dict) -> None:
    try:
        client.post(url, json=body)
    except httpx.HTTPError:
        pass


def test_a_later_start_reaps_the_files_of_a_group_killed_with_sigkill(tmp_path):
    log = tmp_path / "loop.log"
    proc = start_group([sys.executable, str(LOOP), "tiny-diamond"], log)
    try:
        deadline = time.monotonic() + 180
        while "READY" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        # listed while the owner lives: once it is dead, any pipeline starting on this machine
        # (another test's, on the other xdist worker) may reap them before this test looks
        left = owned_segments(proc.pid)
        group, _ = stop_group(proc, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert left, "the running pipeline should have shared-memory files for the SIGKILL to leave behind"
    with Pipeline.from_yaml("tiny-diamond"):
        assert not [name for name in left if os.path.exists(f"/dev/shm/{name}")]
        assert not owned_segments(proc.pid)
    assert not wait_gone(group)
