"""A live server's stage workers: which process is which replica, and which replica holds a
request (from /metrics), for the tests that kill one."""

from __future__ import annotations

import time

import httpx

from omnistage.tests.serving.conftest import cmdline, descendants


def worker_pid(server, pipeline: str, stage: str, replica: int = 0) -> int | None:
    title = f"omnistage: {pipeline}/{stage}#{replica}"
    for pid in descendants(server.proc.pid):
        if cmdline(pid).strip() == title:
            return pid
    return None


def holding_replica(server, pipeline: str, stage: str, wait_s: float = 0.0) -> int | None:
    """A replica of the stage with a request in flight (a stage may have several), polling
    /metrics for up to `wait_s`; None when none holds one."""
    deadline = time.monotonic() + wait_s
    while True:
        for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
            if (
                line.startswith("omnistage_stage_inflight_requests{")
                and f'pipeline="{pipeline}"' in line
                and f'stage="{stage}"' in line
                and float(line.rsplit(" ", 1)[1]) > 0
            ):
                return int(line.split('replica="', 1)[1].split('"', 1)[0])
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
