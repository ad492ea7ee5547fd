"""`omnistage bench jobs [--quick] [--json FILE]`: what the jobs layer costs, and what survives a crash.

Phases, one after the other, on tiny-image (64x64, 2 denoiser steps per job):
- python: the same requests through `Pipeline.generate` in this process, at most
  OMNISTAGE_JOBS_MAX_RUNNING (8) at once, as the jobs scheduler admits them;
- jobs: an `omnistage serve tiny-image` subprocess; all jobs POSTed at once over 16 aiohttp
  connections (submit latency per request; the client's garbage collector off meanwhile),
  each with a webhook to a local aiohttp receiver in a process of its own
  (bench/jobs_receiver.py), which tells the bench when every job has ended (no polling);
  throughput from the first submission to the last completion; webhook latency = arrival at the receiver minus the job's
  finished_at (same machine clock);
- crash: a fresh server; jobs submitted with idempotency keys and webhooks, the server killed
  with SIGKILL (workers too) while they run, started again, every job resubmitted with its key.
The python and jobs phases alternate `--runs` times (default 3); every figure is the median of
the runs, with its spread in `runs` ({median, min, max}); the throughput ratio is taken within
each run (python then jobs, back to back) and its median reported.
Reported (docs/BENCHMARKS.md): submit_ms_p99 (<= 20), ratios.jobs_vs_python_throughput
(>= 0.95), webhook_ms_p50 (<= 50), crash.lost_jobs / crash.lost_webhook_events /
crash.duplicate_jobs (all 0). `--quick`: 40 jobs instead of 1,000, one run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from omnistage.bench.jobs_receiver import Receiver

SECRET = "whsec_" + base64.b64encode(b"omnistage-bench-jobs-secret-01").decode()
PARAMS = {"denoiser": {"width": 64, "height": 64, "num_inference_steps": 2, "seed": 1}}
MAX_RUNNING = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(directory: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONSAFEPATH": "1",
        "OMNISTAGE_JOBS_DIR": str(directory),
        "OMNISTAGE_WEBHOOK_SECRETS": SECRET,
        "OMNISTAGE_WEBHOOK_ALLOW": "127.0.0.0/8",
        "OMNISTAGE_WEBHOOK_SCHEDULE": "0,0.2,0.5,1,2,4",
        "OMNISTAGE_JOBS_MAX_RUNNING": str(MAX_RUNNING),
    }
    exe = Path(sys.executable).parent / "omnistage"
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(exe), "serve", "tiny-image", "--port", str(port)], stdout=out, stderr=out, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log}")
        time.sleep(0.2)
    raise RuntimeError(f"server not ready; see {log}")


def _kill_9(proc: subprocess.Popen) -> None:
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    grandchildren = [
        g for c in children for g in subprocess.run(["pgrep", "-P", c], capture_output=True, text=True).stdout.split()
    ]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for pid in children + grandchildren:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _job(i: int, hook: str) -> dict:
    return {"model": "tiny-image", "inputs": {"prompt": f"job {i}"}, "params": PARAMS, "webhook": {"url": hook}}


def _wait_all(client: httpx.Client, ids: list[str], timeout: float = 1800) -> list[dict]:
    deadline, jobs = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        for job_id in ids:
            if job_id not in jobs or jobs[job_id]["status"] not in ("completed", "failed", "canceled"):
                jobs[job_id] = client.get(f"/v1/jobs/{job_id}").json()
        if all(j["status"] in ("completed", "failed", "canceled") for j in jobs.values()):
            return list(jobs.values())
        time.sleep(0.2)
    raise RuntimeError("jobs did not finish")


def python_phase(n: int) -> float:
    from omnistage.runtime.pipeline import Pipeline

    with Pipeline.from_yaml("tiny-image") as pipeline:
        pipeline.run({"prompt": "warm up"}, PARAMS)

        async def run_all():
            gate = asyncio.Semaphore(MAX_RUNNING)

            async def one(i):
                async with gate:
                    await pipeline.generate({"prompt": f"job {i}"}, PARAMS)

            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            return time.perf_counter() - start

        wall = asyncio.run(run_all())
    return n / wall


async def _submit_all(url: str, n: int, hook: str, concurrency: int = 16) -> list[tuple[str, float, float]]:
    """POST the n jobs from `concurrency` client connections at once; per job: its id, the
    round trip in ms, and the wall-clock time it was sent."""
    import aiohttp

    results: list[tuple[str, float, float] | None] = [None] * n
    todo = iter(range(n))
    connector = aiohttp.TCPConnector(limit=concurrency)
    # The client's own garbage collector stays off while it measures (as timeit does): a full
    # collection over this process's heap (the python phase's torch objects) takes 50-100 ms,
    # which every request in flight would count as the server's latency.
    gc.disable()
    try:
        async with aiohttp.ClientSession(url, connector=connector) as session:

            async def client():
                for i in todo:
                    sent, t0 = time.time(), time.perf_counter()
                    async with session.post("/v1/jobs", json=_job(i, hook)) as r:
                        job = await r.json()
                    results[i] = (job["id"], (time.perf_counter() - t0) * 1000, sent)

            await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        gc.enable()
    return results


def jobs_phase(n: int, work: Path, receiver: Receiver) -> dict:
    proc, url = _start_server(work / "jobs-phase", work / "server.log")
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            client.post("/v1/pipelines/tiny-image/run", json={"inputs": {"prompt": "warm"}, "params": PARAMS})
            results = asyncio.run(_submit_all(url, n, receiver.url))
            # told by the webhooks, as a client of the jobs API is, rather than polling every job
            # (which would spend server time the python phase does not); then each job read once
            ids = [r[0] for r in results]
            receiver.wait("ended", len(ids), timeout=1800)
            jobs = _wait_all(client, ids)
            completed, _ = receiver.state()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    first_submit = min(r[2] for r in results)
    wall = max(j["finished_at"] for j in jobs) - first_submit
    latencies = sorted(r[1] for r in results)
    webhook_ms = sorted((completed[j["id"]][0] - j["finished_at"]) * 1000 for j in jobs if j["id"] in completed)
    return {
        "jobs_per_s": n / wall,
        "submit_ms_p50": statistics.median(latencies),
        "submit_ms_p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "webhook_ms_p50": statistics.median(webhook_ms) if webhook_ms else None,
        "failed": sum(j["status"] != "completed" for j in jobs),
    }


def crash_phase(n: int, work: Path) -> dict:
    receiver = Receiver()
    directory = work / "crash-phase"
    keys = [f"bench-crash-{i}" for i in range(n)]
    proc, url = _start_server(directory, work / "crash-server.log")
    with httpx.Client(base_url=url, timeout=60) as client:
        for i, key in enumerate(keys):
            client.post("/v1/jobs", json=_job(i, receiver.url), headers={"Idempotency-Key": key})
        receiver.wait("completed", n // 4, timeout=120)
    _kill_9(proc)
    proc, url = _start_server(directory, work / "crash-server.log")
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            ids = [
                client.post("/v1/jobs", json=_job(i, receiver.url), headers={"Idempotency-Key": key}).json()["id"]
                for i, key in enumerate(keys)
            ]
            jobs = _wait_all(client, ids)
            listed = client.get("/v1/jobs", params={"limit": 100}).json()
            total = len(listed["data"])
            after = listed["data"][-1]["id"] if listed["data"] else None
            while listed["has_more"]:
                listed = client.get("/v1/jobs", params={"limit": 100, "after": after}).json()
                total += len(listed["data"])
                after = listed["data"][-1]["id"] if listed["data"] else after
            receiver.wait("completed", n, timeout=30)
            completed, _ = receiver.state()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        receiver.close()
    return {
        "lost_jobs": sum(j["status"] != "completed" for j in jobs),
        "duplicate_jobs": total - n,
        "lost_webhook_events": sum(1 for i in ids if i not in completed),
        "reruns": sum(j["attempts"] > 1 for j in jobs),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omnistage bench jobs")
    parser.add_argument("--quick", action="store_true", help="40 jobs instead of 1,000, one run (a smoke run)")
    parser.add_argument("--jobs", type=int, help="jobs per phase (default 1,000; --quick 40)")
    parser.add_argument("--runs", type=int, help="python + jobs phase pairs (default 3; --quick 1)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    n = args.jobs or (40 if args.quick else 1000)
    runs = args.runs or (1 if args.quick else 3)
    per_run = []
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-jobs-") as tmp:
        work = Path(tmp)
        for run in range(runs):
            (work / f"run{run}").mkdir()
            python_rate = python_phase(n)
            receiver = Receiver()
            try:
                jobs = jobs_phase(n, work / f"run{run}", receiver)
            finally:
                receiver.close()
            per_run.append({**jobs, "python_jobs_per_s": python_rate, "ratio": jobs["jobs_per_s"] / python_rate})
            print(f"run {run + 1}/{runs}: {json.dumps(per_run[-1])}", file=sys.stderr)
        crash = crash_phase(max(8, n // 10), work)
    figures = {
        key: _spread([r[key] for r in per_run if r[key] is not None])
        for key in ("submit_ms_p99", "submit_ms_p50", "webhook_ms_p50", "jobs_per_s", "python_jobs_per_s", "ratio")
        if any(r[key] is not None for r in per_run)
    }
    median = {key: value["median"] for key, value in figures.items()}
    result = {
        "jobs": n,
        "runs_count": runs,
        "submit_ms_p99": median["submit_ms_p99"],
        "submit_ms_p50": median["submit_ms_p50"],
        "webhook_ms_p50": median.get("webhook_ms_p50"),
        "throughput": {"python_jobs_per_s": median["python_jobs_per_s"], "jobs_per_s": median["jobs_per_s"]},
        "ratios": {"jobs_vs_python_throughput": median["ratio"]},
        "failed_jobs": sum(r["failed"] for r in per_run),
        "crash": crash,
        "runs": figures,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
