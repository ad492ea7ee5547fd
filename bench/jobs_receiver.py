"""The webhook receiver of `bench jobs`, in a process of its own (as a user's endpoint is):
in the bench process, its deliveries would take the interpreter from the client whose
submission round trips are being timed.

`python -m omnistage.bench.jobs_receiver` serves on a free loopback port and prints it:
- POST /hook: a webhook delivery; the arrival time of each job.completed is kept per job, and
  every job.completed / failed / canceled marks the job ended;
- GET /state: {"completed": {job id: [arrival times]}, "ended": [job ids]};
- GET /wait?what=completed|ended&count=N&timeout=S: answers once N distinct jobs are in that
  set (or at the timeout) with {"count": n}, so the bench waits without polling.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx


def _app():
    from aiohttp import web

    completed: dict[str, list[float]] = {}
    ended: set[str] = set()
    changed = asyncio.Condition()

    async def hook(request: web.Request) -> web.Response:
        body = await request.json()
        if body["type"] == "job.completed":
            completed.setdefault(body["data"]["id"], []).append(time.time())
        if body["type"] in ("job.completed", "job.failed", "job.canceled"):
            ended.add(body["data"]["id"])
        async with changed:
            changed.notify_all()
        return web.Response(status=200)

    async def state(request: web.Request) -> web.Response:
        return web.json_response({"completed": completed, "ended": sorted(ended)})

    async def wait(request: web.Request) -> web.Response:
        which = completed if request.query["what"] == "completed" else ended
        count, timeout = int(request.query["count"]), float(request.query["timeout"])
        try:
            async with changed:
                await asyncio.wait_for(changed.wait_for(lambda: len(which) >= count), timeout)
        except TimeoutError:
            pass
        return web.json_response({"count": len(which)})

    app = web.Application()
    app.router.add_post("/hook", hook)
    app.router.add_get("/state", state)
    app.router.add_get("/wait", wait)
    return app


async def _serve() -> None:
    from aiohttp import web

    runner = web.AppRunner(_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()


class Receiver:
    """The receiver process, seen from the bench: its hook URL, what it received, waits."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omnistage.bench.jobs_receiver"], stdout=subprocess.PIPE, text=True
        )
        port = int(self.proc.stdout.readline())
        self.base = f"http://127.0.0.1:{port}"
        self.url = f"{self.base}/hook"

    def wait(self, what: str, count: int, timeout: float) -> int:
        """Waits until `count` distinct jobs are `what` (completed or ended); how many are."""
        params = {"what": what, "count": count, "timeout": timeout}
        return httpx.get(f"{self.base}/wait", params=params, timeout=timeout + 30).json()["count"]

    def state(self) -> tuple[dict[str, list[float]], set[str]]:
        """Every job.completed arrival per job, and the jobs that ended."""
        body = httpx.get(f"{self.base}/state", timeout=30).json()
        return body["completed"], set(body["ended"])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


if __name__ == "__main__":
    asyncio.run(_serve())
