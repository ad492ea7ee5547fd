"""A real `omnistage serve` subprocess on a free port, plus /proc helpers (no psutil)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).parent
OMNISTAGE = Path(sys.executable).parent / "omnistage"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_parents() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process, from /proc/*/stat."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the command name (field 2) may hold spaces: split after its closing parenthesis
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    return parents


def descendants(pid: int) -> set[int]:
    """Every live descendant of `pid`, from /proc/*/stat parent links."""
    parents, found, frontier = process_parents(), set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def shm_segments_of(pids: set[int]) -> list[str]:
    """/dev/shm files named by the runtime's `<prefix>-<pid>-<n>` scheme for these pids."""
    marks = {f"-{p}-" for p in pids}
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    return [n for n in names if any(m in n for m in marks)]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path
    # (seconds since start, /health status, /ready status) seen while waiting for readiness
    probes: list[tuple[float, int, int]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_ready(self, timeout: float = 90.0) -> None:
        start = time.monotonic()
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while time.monotonic() - start < timeout:
                if self.proc.poll() is not None:
                    raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    health = client.get("/health").status_code
                    ready = client.get("/ready").status_code
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                self.probes.append((time.monotonic() - start, health, ready))
                if ready == 200:
                    return
                time.sleep(0.05)
        raise AssertionError(f"server not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(args: list[str], log_path: Path, port: int | None = None) -> ServerProcess:
    port = port or free_port()
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [str(OMNISTAGE), "serve", *args, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=log_path.parent,
    )
    log.close()
    return ServerProcess(proc, port, log_path)


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    """tests/serving/slow-scale.yaml served with its first stage taking 2 s to build and
    sleeping 0.2 s per call (requests may ask for longer with params {"slow": {"delay_s": ...}})."""
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    server = start_server(
        [
            str(HERE / "slow-scale.yaml"),
            "--drain-timeout",
            "30",
            "--set",
            "slow-scale:stages.slow.params.kwargs.delay_s=0.2",
            # a stage that takes seconds to build, so /ready is seen at 503 whatever the load
            "--set",
            "slow-scale:stages.slow.params.kwargs.build_delay_s=2",
        ],
        log_path,
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


# tiny_server (the shipped tiny pipelines) is tests/conftest.py's: other folders share it
