"""A local Ray (2 CPUs) per test module, running the tiny pipelines as one Serve application.

The application is the one `omnistage serve --backend ray` runs (ray_serve/app.py): stage
deployments and the FastAPI ingress behind Serve's HTTP proxy. Teardown shuts Serve and Ray
down and checks that no process Ray started is left, the replicas' engine processes included.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

APP = "omnistage"
CONFIGS = ["tiny-llm", "tiny-image", "tiny-diamond"]
# 9 stage replicas on 2 CPUs: each reserves a fifth of one (the machine's cores are shared as
# the embedded runtime shares them)
CPUS_PER_THREAD = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


RAY_PROCESS = re.compile(r"raylet|gcs_server|ray::|/ray/")


def ray_processes(pids: set[int]) -> set[int]:
    """Those of `pids` that Ray started (its daemons and workers; not the embedded runtime's
    fork server, which the module's other fixtures may have started meanwhile)."""
    found = set()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if RAY_PROCESS.search(cmdline):
            found.add(pid)
    return found


def processes_below(ray_pids: set[int]) -> set[int]:
    """The processes that Ray's processes started and that are not Ray's own."""
    return set().union(*(descendants(pid) for pid in ray_pids)) - ray_pids


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(pid)
    return left


@dataclass
class RayApp:
    url: str

    def handles(self, pipeline: str, stages, app: str = APP) -> dict:
        from ray import serve

        from omnistage.ray_serve.options import deployment_name

        return {s: serve.get_deployment_handle(deployment_name(pipeline, s), app_name=app) for s in stages}

    def pipeline(self, config: str, app: str = APP):
        """A RayPipeline in the test process over an application's stage deployments."""
        from omnistage.graph.loader import load_pipeline
        from omnistage.ray_serve.pipeline import RayPipeline

        spec = load_pipeline(config)
        return RayPipeline.connect(spec, self.handles(spec.name, spec.stages, app), app, ready_timeout=120)

    def wait_ready(self, timeout: float = 300.0) -> dict:
        end = time.monotonic() + timeout
        while True:
            try:
                r = httpx.get(self.url + "/ready", timeout=5)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "the Serve application never became ready"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def ray_app():
    import ray
    from ray import serve

    from omnistage.ray_serve.app import build_app

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster
    before = descendants(os.getpid())
    engines: set[int] = set()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"configs": CONFIGS, "options": {"cpus_per_thread": CPUS_PER_THREAD}}
        serve.run(
            build_app(args), name=APP, route_prefix="/", blocking=False, logging_config={"enable_access_log": False}
        )
        app = RayApp(f"http://127.0.0.1:{port}")
        app.wait_ready()
        # the stage replicas' engine processes (ray_serve/engine_process.py), below Ray's workers
        engines = processes_below(ray_processes(descendants(os.getpid()) - before))
        assert engines, "no process below Ray's: the replicas run their engines in their own process"
        yield app
    finally:
        started = ray_processes(descendants(os.getpid()) - before)
        assert started, "no Ray process found: the leftover check below would check nothing"
        started |= engines | processes_below(started)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        end = time.monotonic() + 30
        while alive(started) and time.monotonic() < end:
            time.sleep(0.2)
        assert not alive(started), f"Ray left processes behind: {sorted(alive(started))}"
