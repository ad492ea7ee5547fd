"""`omnistage bench api [--quick] [--json FILE]`: what the OpenAI HTTP layer costs.

The tiny LLM pipeline answers the same streamed chat requests (fixed prompts, greedy,
`ignore_eos` so every request makes exactly `max_tokens` tokens) twice in one run:
- python: `Pipeline.stream` in this process (the Python API, no HTTP);
- http: `POST /v1/chat/completions` with `stream: true` to an `omnistage serve tiny-llm`
  subprocess, read by an aiohttp client in this process (the client vLLM's serving benchmark
  uses; on a small machine the client shares the cores with the server, so its own cost per
  token counts against the server's figures).
The two phases run one after the other (never both at once), each at concurrency 1 and 64
(`--quick`: 1 and 4, fewer and shorter requests). Per phase and concurrency: time to the first
content token (p50, p99) and completion tokens per second over the phase's wall time.
Both systems stay up for the whole run and take turns: repeat r runs python's phase, then
http's (`--repeats`, default 3; `--quick`: 1). Reported per repeat and as the median over the
repeats with min and max: ratios.http_vs_python_throughput_c64 (target >= 0.9) and
http_overhead_ms.ttft_p50_c1 (http TTFT p50 minus python's at concurrency 1; target <= 2);
`systems` holds the repeat whose throughput ratio is the median.
Each level also reports the CPU time per completion token of every process taking part
(`cpu_us_per_token`: the caller or client in this process, the server's main process, the
stage workers), and the run records the load average at its start and end: on a shared machine
the wall-clock figures move with the load, the CPU cost per token much less.
`--server-cpus LIST --worker-cpus LIST` place the processes (docs/serving.md, "CPU placement"):
the server runs with `--cpus`, and the LLM stage's workers of both systems with `pool.cpus`.
`--client-cpus LIST` pins this process (the aiohttp client and the Python API's caller, so
both systems' front ends) to those CPUs; without it the caller and the client stay where the
OS puts them. A load generator is not part of either system, and on a 2-core machine it
otherwise takes turns with the LLM worker that bounds both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omnistage.graph.fields import parse_cpu_list
from omnistage.runtime.cpu_affinity import ALL_CPUS_ENV, check_cpus, pin_process

TARGETS = {"http_vs_python_throughput_c64": (">=", 0.9), "ttft_p50_c1": ("<=", 2.0)}
PROMPTS = [
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "What is a paged KV cache?",
    "Translate 'good morning' to French.",
]


@dataclass(frozen=True)
class Placement:
    """Where the processes run: the server's --cpus, the LLM workers' pool.cpus and this
    process's CPUs (the client and the Python API's caller); None: anywhere."""

    server_cpus: str | None = None
    worker_cpus: str | None = None
    client_cpus: str | None = None

    def overrides(self) -> list[str]:
        return [f"stages.llm.pool.cpus={self.worker_cpus}"] if self.worker_cpus else []

    def serve_args(self) -> list[str]:
        # the server inherits this process's affinity: unpinned, it gets back every CPU
        server_cpus = self.server_cpus or (os.environ.get(ALL_CPUS_ENV) if self.client_cpus else None)
        args = ["--cpus", server_cpus] if server_cpus else []
        return args + [f"--set={o}" for o in self.overrides()]

    def pin_client(self) -> None:
        """Narrows this process to `client_cpus` before the Python API's workers are forked
        (they take `pool.cpus`, or the CPUs this process had)."""
        if self.client_cpus:
            pin_process(parse_cpu_list(self.client_cpus))


@dataclass(frozen=True)
class Plan:
    concurrencies: tuple[int, ...]
    requests_per_level: dict[int, int]
    max_tokens: int

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls((1, 4), {1: 2, 4: 4}, 8)
        # c64: 512 requests, several seconds of steady load (128 gave a one-second phase whose
        # ratio moved by a fifth between repeats)
        return cls((1, 64), {1: 16, 64: 512}, 64)


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


async def _python_one(pipeline, i: int, max_tokens: int) -> tuple[float, int]:
    params = {"llm": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}}
    start, ttft, tokens = time.perf_counter(), None, 0
    async for chunk in pipeline.stream({"messages": _messages(i)}, params):
        if chunk.port == "text" and chunk.data and ttft is None:
            ttft = time.perf_counter() - start
        elif chunk.port == "info" and chunk.data:
            tokens = chunk.data["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - start), tokens


async def _http_one(session, i: int, max_tokens: int) -> tuple[float, int]:
    body = {
        "model": "tiny-llm",
        "messages": _messages(i),
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, ttft, tokens = time.perf_counter(), None, 0
    async with session.post("/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:  # one SSE line per iteration
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - start), tokens


def _cpu_s(pid: int) -> float:
    """CPU seconds all threads of a process have run so far (schedstat: nanoseconds, where
    /proc/PID/stat counts 10 ms ticks); threads that ended meanwhile are not counted."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (the server's fork server and stage workers)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return sorted(found)


async def _level(one, concurrency: int, total: int, processes: dict[str, list[int]]) -> dict[str, Any]:
    """`total` requests, at most `concurrency` in flight; `processes`: role -> pids whose CPU
    time per token is reported."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(i):
        async with gate:
            return await one(i)

    cpu_before = {role: sum(_cpu_s(p) for p in pids) for role, pids in processes.items()}
    start = time.perf_counter()
    results = await asyncio.gather(*(gated(i) for i in range(total)))
    wall = time.perf_counter() - start
    cpu = {role: sum(_cpu_s(p) for p in pids) - cpu_before[role] for role, pids in processes.items()}
    ttfts = sorted(r[0] * 1000 for r in results)
    tokens = sum(r[1] for r in results)
    return {
        "requests": total,
        "ttft_ms_p50": statistics.median(ttfts),
        "ttft_ms_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "cpu_us_per_token": {role: 1e6 * seconds / max(1, tokens) for role, seconds in cpu.items()},
    }


async def _phase(one, plan: Plan, progress: bool, name: str, processes: dict[str, list[int]]) -> dict[str, Any]:
    await one(0)  # warm-up (prefix cache, connections), not counted
    out = {}
    for c in plan.concurrencies:
        out[f"c{c}"] = await _level(one, c, plan.requests_per_level[c], processes)
        if progress:
            level = out[f"c{c}"]
            cpu = ", ".join(f"{role} {us:.0f}" for role, us in level["cpu_us_per_token"].items())
            print(f"[bench api] {name} c={c}: {level['tokens_per_s']:.0f} tok/s (CPU us/token: {cpu})", file=sys.stderr)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int, log_dir: Path, placement: Placement) -> subprocess.Popen:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMNISTAGE_JOBS_DIR": str(log_dir / "jobs")}
    omnistage = Path(sys.executable).parent / "omnistage"
    log = open(log_dir / "server.log", "wb")
    cmd = [str(omnistage), "serve", "tiny-llm", "--port", str(port), "--log-level", "warning"]
    cmd += placement.serve_args()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"omnistage serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("omnistage serve did not become ready")


async def _http_phase(url: str, plan: Plan, progress: bool, server_pid: int) -> dict[str, Any]:
    import aiohttp

    # Idle connections are dropped before uvicorn's 5 s keep-alive ends, so the client never
    # sends a request on a connection the server is closing (a reset on a loaded machine).
    connector = aiohttp.TCPConnector(limit=max(plan.concurrencies) + 4, keepalive_timeout=2.0)
    processes = {"client": [os.getpid()], "server": [server_pid], "stage_workers": _descendants(server_pid)}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as session:
        return await _phase(lambda i: _http_one(session, i, plan.max_tokens), plan, progress, "http", processes)


def _figures(plan: Plan, python: dict[str, Any], http: dict[str, Any]) -> dict[str, float]:
    low, high = f"c{plan.concurrencies[0]}", f"c{plan.concurrencies[-1]}"
    return {
        "http_vs_python_throughput_c64": http[high]["tokens_per_s"] / python[high]["tokens_per_s"],
        "ttft_p50_c1": http[low]["ttft_ms_p50"] - python[low]["ttft_ms_p50"],
    }


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def _affinity(pids: list[int]) -> list[list[int]]:
    return [sorted(os.sched_getaffinity(pid)) for pid in pids]


def _run_pairs(plan: Plan, repeats: int, placement: Placement, progress: bool) -> tuple[list[dict[str, Any]], dict]:
    """`repeats` python/http phase pairs against one in-process pipeline and one server; and
    the CPUs each process was allowed (as the OS reports them)."""
    from omnistage import Pipeline

    runs: list[dict[str, Any]] = []
    with Pipeline.from_yaml("tiny-llm", placement.overrides()) as pipeline, tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        proc = _serve(port, Path(tmp), placement)
        workers = [pid for pids in pipeline.worker_pids().values() for pid in pids if pid is not None]
        python_processes = {"caller": [os.getpid()], "stage_workers": workers}
        try:
            _wait_ready(f"http://127.0.0.1:{port}", proc)
            server_workers = [
                p for p in _descendants(proc.pid) if b"omnistage: " in Path(f"/proc/{p}/cmdline").read_bytes()
            ]
            cpus = {
                "client": _affinity([os.getpid()])[0],
                "python_workers": _affinity(workers),
                "server": _affinity([proc.pid])[0],
                "server_workers": _affinity(server_workers),
            }
            for _ in range(repeats):
                python = asyncio.run(
                    _phase(
                        lambda i: _python_one(pipeline, i, plan.max_tokens), plan, progress, "python", python_processes
                    )
                )
                http = asyncio.run(_http_phase(f"http://127.0.0.1:{port}", plan, progress, proc.pid))
                runs.append({"python": python, "http": http, "figures": _figures(plan, python, http)})
        finally:
            proc.terminate()
            proc.wait(60)
    return runs, cpus


def run_bench(
    quick: bool, progress: bool = True, repeats: int | None = None, placement: Placement | None = None
) -> dict[str, Any]:
    placement = placement or Placement()
    plan = Plan.make(quick)
    repeats = repeats or (1 if quick else 3)
    load_start = os.getloadavg()
    affinity = os.sched_getaffinity(0)
    placement.pin_client()
    try:
        runs, cpus = _run_pairs(plan, repeats, placement, progress)
    finally:
        os.sched_setaffinity(0, affinity)
    spread = {key: _spread([r["figures"][key] for r in runs]) for key in TARGETS}
    ratio = spread["http_vs_python_throughput_c64"]["median"]
    middle = next(r for r in runs if r["figures"]["http_vs_python_throughput_c64"] == ratio) if repeats % 2 else runs[0]
    return {
        "bench": "api",
        "quick": quick,
        "plan": {"concurrencies": list(plan.concurrencies), "max_tokens": plan.max_tokens, "repeats": repeats},
        "placement": asdict(placement),
        "cpus": cpus,
        "systems": {"python": middle["python"], "http": middle["http"]},
        "runs": runs,
        "ratios": {"http_vs_python_throughput_c64": ratio},
        "http_overhead_ms": {"ttft_p50_c1": spread["ttft_p50_c1"]["median"]},
        "spread": spread,
        "targets": {k: {"op": op, "value": v} for k, (op, v) in TARGETS.items()},
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="omnistage bench api", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: concurrency 1 and 4, 8 tokens")
    ap.add_argument("--json", dest="json_path", help="write the results to this file")
    ap.add_argument("--repeats", type=int, default=None, help="python/http phase pairs (default 3; --quick: 1)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--server-cpus", metavar="LIST", help="the server's CPUs (its --cpus), e.g. 0")
    ap.add_argument("--worker-cpus", metavar="LIST", help="the LLM stage workers' CPUs (pool.cpus), e.g. 1")
    ap.add_argument("--client-cpus", metavar="LIST", help="this process's CPUs (client and Python API caller), e.g. 0")
    args = ap.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        ap.error("--repeats must be at least 1")
    placement = Placement(args.server_cpus, args.worker_cpus, args.client_cpus)
    if args.client_cpus:
        try:
            check_cpus(parse_cpu_list(args.client_cpus))
        except ValueError as err:
            ap.error(f"--client-cpus: {err}")
    result = run_bench(quick=args.quick, progress=not args.no_progress, repeats=args.repeats, placement=placement)
    result["command"] = "omnistage bench api " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
