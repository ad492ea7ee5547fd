"""`omnistage bench soak --minutes N [--json FILE]`: mixed traffic at ~80% of capacity against
a real `omnistage serve tiny-llm tiny-image`, then what leaked.

Phases: calibration (closed-loop clients with no pause: 2 streamed chats, 1 image, 1 job;
their mean latency per kind), warm-up (the same clients, each pausing 0.25 x its kind's
calibrated latency between requests, so each is busy ~80% of the time), the soak itself
(the same load for N minutes), then idle. The server's process tree is measured while idle
right before the soak ("start") and right after it ("end"): KV blocks held (/metrics),
shared-memory segments still held by a reader (the pool files kept for reuse are reported
apart, as shm_pool_files), open file descriptors other than those on the pool files,
threads, processes, RSS per process. Last, the server gets SIGTERM and what survives it is counted.

JSON: leaks {kv_blocks, shm_segments, fds, threads, processes} (growth from start to end,
0 when clean; fds_opened lists what new descriptors point to), after_stop {processes, shm_segments}, errors_5xx (5xx answers and in-band
stream errors), rss_growth_pct (the largest growth of one process), p99_s per kind over the
soak's first and last fifth, requests per kind. The numbers are the server's own; the
clients run in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from omnistage.bench.soak_traffic import Outcome, Traffic, p99

CLIENTS = {"chat": 2, "image": 1, "job": 1}
BUSY_FRACTION = 0.8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z":
                kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def process_tree(pid: int) -> list[int]:
    kids, found, frontier = _children(), [pid], [pid]
    while frontier:
        frontier = [c for p in frontier for c in kids.get(p, [])]
        found += frontier
    return [p for p in found if os.path.exists(f"/proc/{p}")]


def _status_field(pid: int, name: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _metric_sum(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def fd_targets(pid: int) -> list[str]:
    """What the process's open descriptors point to, less the runtime's shared-memory pool files
    (their number follows the pools' size, which a held-segment count judges)."""
    targets: list[str] = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    except OSError:
        pass
    return [t for t in targets if not t.startswith("/dev/shm/omnistage-")]


_TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "0A": "LISTEN"}


def describe_fd(pid: int, target: str) -> str:
    """`target` with what a socket is: "socket:[N] tcp 127.0.0.1:8000 <- 127.0.0.1:5123
    CLOSE_WAIT" (the kernel's tables), so a leaked descriptor says where it leads."""
    if not target.startswith("socket:["):
        return target
    inode = target[len("socket:[") : -1]
    for table in ("tcp", "tcp6", "udp", "unix"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if table == "unix" and len(cols) >= 7 and cols[6] == inode:
                return f"{target} unix {cols[7] if len(cols) > 7 else '(unnamed)'}"
            if table != "unix" and len(cols) >= 10 and cols[9] == inode:
                local, remote = (_address(c) for c in cols[1:3])
                return f"{target} {table} {local} <- {remote} {_TCP_STATES.get(cols[3], cols[3])}"
    return target


def _address(hex_address: str) -> str:
    host, port = hex_address.split(":")
    if len(host) == 8:  # IPv4, little-endian
        host = ".".join(str(int(host[i : i + 2], 16)) for i in (6, 4, 2, 0))
    return f"{host}:{int(port, 16)}"


def tree_resources(root: int) -> dict:
    """Open file descriptors, threads, processes and RSS per process of `root`'s tree."""
    pids = process_tree(root)
    others = [t for pid in pids for t in fd_targets(pid)]
    return {
        "fds": len(others),
        "fd_targets": others,
        "threads": sum(_status_field(pid, "Threads") for pid in pids),
        "processes": len(pids),
        "rss_kib": {str(pid): _status_field(pid, "VmRSS") for pid in pids},
    }


def _new_targets(before: list[str], after: list[str]) -> list[str]:
    """What the descriptors open at the end and not at the start point to (a multiset difference)."""
    left = list(before)
    new = []
    for t in after:
        if t in left:
            left.remove(t)
        else:
            new.append(t)
    return new


def _segment_held(path: str) -> bool:
    """A segment some reader has not released (runtime/shm.py's header: byte 0 = readers,
    then one released flag per reader). Pools keep free segments for reuse, so a pool that
    grew to a new high-water mark is not a leak; a segment still held at idle is."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    n = head[0] if head else 0
    return n > 0 and head[1 : 1 + n] != b"\x01" * n


def snapshot(server_pid: int, url: str) -> dict:
    """The server tree's resources, taken while no request runs. The descriptors are counted
    before the metrics are asked for: the server closes its side of that request's connection a
    moment after the client has, and a count taken in between would see one socket more."""
    resources = tree_resources(server_pid)
    held = _metric_sum(url, "omnistage_engine_kv_blocks_total") - _metric_sum(url, "omnistage_engine_kv_blocks_free")
    files = [os.path.join("/dev/shm", f) for f in os.listdir("/dev/shm") if f.startswith(f"omnistage-{server_pid}-")]
    return {
        "kv_blocks": int(held),
        "shm_segments": sum(1 for f in files if _segment_held(f)),
        "shm_files": len(files),
        **resources,
    }


def _start(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    exe = Path(sys.executable).parent / "omnistage"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMNISTAGE_JOBS_DIR": str(workdir / "jobs")}
    with open(workdir / "server.log", "wb") as out:
        proc = subprocess.Popen(
            [str(exe), "serve", "tiny-llm", "tiny-image", "--port", str(port)],
            stdout=out,
            stderr=out,
            env=env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {(workdir / 'server.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server not ready after 600 s")


def _phase(url: str, seconds: float, think: dict[str, float]) -> list[Outcome]:
    traffic = Traffic(url, CLIENTS, think).start()
    time.sleep(seconds)
    outcomes = traffic.stop()
    if traffic.errors:
        raise RuntimeError(f"transport errors: {traffic.errors[:3]}")
    return outcomes


# idle time before a snapshot: longer than uvicorn's keep-alive timeout (5 s), with a margin for a
# loaded machine, so the clients' idle connections are closed on the server's side too
IDLE_S = 7.0


def _window_p99(outcomes: list[Outcome], lo: float, hi: float) -> dict[str, float]:
    return {
        kind: round(p99([o.seconds for o in outcomes if o.kind == kind and lo <= o.start < hi]), 4) for kind in CLIENTS
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def run(minutes: float, workdir: Path, log=print) -> dict:
    proc, url = _start(workdir)
    try:
        soak_s = minutes * 60.0
        cal = _phase(url, max(5.0, 0.1 * soak_s), {})
        think = {k: round((1 / BUSY_FRACTION - 1) * _mean([o.seconds for o in cal if o.kind == k]), 4) for k in CLIENTS}
        log(f"calibrated: think time per kind {think}")
        _phase(url, max(5.0, 0.2 * soak_s), think)  # warm-up: pools and caches reach their size
        time.sleep(IDLE_S)
        start = snapshot(proc.pid, url)
        t0 = time.monotonic()
        log(f"soak: {minutes:g} min of mixed traffic")
        outcomes = _phase(url, soak_s, think)
        time.sleep(IDLE_S)
        end = snapshot(proc.pid, url)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    deadline = time.monotonic() + 15  # the fork server and resource tracker leave on their own
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in end["rss_kib"]):
        time.sleep(0.1)
    survivors = [p for p in end["rss_kib"] if os.path.exists(f"/proc/{p}")]  # pids as str
    left_files = [f for f in os.listdir("/dev/shm") if f.startswith(f"omnistage-{proc.pid}-")]
    growth = [
        100.0 * (end["rss_kib"][pid] - kib) / kib
        for pid, kib in start["rss_kib"].items()
        if kib and pid in end["rss_kib"]
    ]
    fifth = soak_s / 5
    return {
        "minutes": minutes,
        "clients": CLIENTS,
        "think_s": think,
        "requests": {k: sum(1 for o in outcomes if o.kind == k) for k in CLIENTS},
        "failed": sum(1 for o in outcomes if not o.ok),
        "errors_5xx": sum(1 for o in outcomes if o.status >= 500 or (o.status == 200 and o.code)),
        "leaks": {k: max(0, end[k] - start[k]) for k in ("kv_blocks", "shm_segments", "fds", "threads", "processes")},
        "fds_opened": _new_targets(start["fd_targets"], end["fd_targets"]),
        "kv_blocks_held_at_end": end["kv_blocks"],
        "shm_pool_files": {"start": start["shm_files"], "end": end["shm_files"]},
        "after_stop": {"processes": len(survivors), "shm_segments": len(left_files)},
        "rss_growth_pct": round(max(growth, default=0.0), 2),
        "p99_s": {
            "start": _window_p99(outcomes, t0, t0 + fifth),
            "end": _window_p99(outcomes, t0 + 4 * fifth, t0 + soak_s),
        },
        "start": start,
        "end": end,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omnistage bench soak", description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the soak itself (default 30)")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--quick", action="store_true", help="--minutes 0.5")
    args = parser.parse_args(argv)
    minutes = 0.5 if args.quick else args.minutes
    with tempfile.TemporaryDirectory(prefix="omnistage-soak-") as tmp:
        result = run(minutes, Path(tmp))
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    summary = {k: result[k] for k in ("requests", "errors_5xx", "leaks", "after_stop", "rss_growth_pct", "p99_s")}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
