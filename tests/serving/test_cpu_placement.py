"""`omnistage serve --cpus`: the server process runs on the CPUs given, a stage with
`pool.cpus` on its own, and the other stages' workers keep every CPU the server had before
(the kernel's affinity of each process, read from /proc, is the judge)."""

import os

import httpx
import pytest

from omnistage.tests.serving.conftest import cmdline, descendants, start_server

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")


def test_serve_places_the_server_and_the_stage_workers(tmp_path):
    every_cpu = os.sched_getaffinity(0)
    args = ["tiny-diamond", "--cpus", "0", "--set", "tiny-diamond:stages.dense.pool.cpus=1", "--log-level", "warning"]
    server = start_server(args, tmp_path / "server.log")
    try:
        server.wait_ready()
        assert os.sched_getaffinity(server.proc.pid) == {0}
        workers = {pid: cmdline(pid) for pid in descendants(server.proc.pid) if "tiny-diamond/" in cmdline(pid)}
        dense = [pid for pid, title in workers.items() if "tiny-diamond/dense" in title]
        others = [pid for pid in workers if pid not in dense]
        assert dense and len(others) >= 3, workers
        assert all(os.sched_getaffinity(pid) == {1} for pid in dense)
        assert all(os.sched_getaffinity(pid) == every_cpu for pid in others)
        body = {"inputs": {"x": [[0.5] * 8]}}
        r = httpx.post(f"{server.url}/v1/pipelines/tiny-diamond/run", json=body, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.stop()
    assert server.proc.returncode == 0, server.log()


def test_serve_refuses_cpus_the_machine_lacks(tmp_path):
    server = start_server(["tiny-llm", "--cpus", "0,4096"], tmp_path / "server.log")
    assert server.proc.wait(60) == 2
    assert "argument --cpus: no CPU 4096 on this machine" in server.log()
