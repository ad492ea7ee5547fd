"""The tiny pipelines through Ray Serve (one local Ray for the module, see conftest.py) against
the embedded runtime as the judge: the same tokens, pixels and tensors; streaming that arrives
in chunks over HTTP; a cancel that empties the engines; a killed replica that fails only its
own request, shows on /ready, and is replaced by Serve."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from omnistage.errors import WorkerDiedError
from omnistage.runtime.pipeline import Pipeline
from omnistage.tests.runtime.conftest import SMALL_YAML, pid_exists

PROMPTS = ["Once upon a time", "The capital of France is", "1 2 3 4", "hello"]
GREEDY = {"llm": {"temperature": 0.0, "max_tokens": 12}}
SAMPLED = {"llm": {"temperature": 1.0, "seed": 3, "max_tokens": 12}}
LONG = {"llm": {"temperature": 0.0, "max_tokens": 2000, "ignore_eos": True}}
IMAGE = ({"prompt": "a red cube"}, {"denoiser": {"num_inference_steps": 2, "seed": 7}})
X = torch.linspace(-1, 1, 11 * 8).reshape(11, 8)


@pytest.fixture(scope="module")
def embedded():
    """Each pipeline's outputs from the embedded runtime, run before Ray starts."""
    out = {}
    with Pipeline.from_yaml("tiny-llm") as p:
        out["greedy"] = [p.run({"prompt": q}, GREEDY)["tokens"] for q in PROMPTS]
        out["sampled"] = p.run({"prompt": PROMPTS[0]}, SAMPLED)["tokens"]
    with Pipeline.from_yaml("tiny-image") as p:
        out["image"] = p.run(*IMAGE)["image"]
    with Pipeline.from_yaml("tiny-diamond") as p:
        out["diamond"] = p.run({"x": X})
    return out


def test_outputs_equal_the_embedded_runtime(embedded, ray_app):
    with ray_app.pipeline("tiny-llm") as llm:
        # all at once: one replica batches them in its engine steps
        async def together():
            return await asyncio.gather(*(llm.generate({"prompt": q}, GREEDY) for q in PROMPTS))

        assert [o["tokens"] for o in asyncio.run(together())] == embedded["greedy"]
        assert llm.run({"prompt": PROMPTS[0]}, SAMPLED)["tokens"] == embedded["sampled"]
    with ray_app.pipeline("tiny-image") as image:
        assert torch.equal(image.run(*IMAGE)["image"], embedded["image"])
    with ray_app.pipeline("tiny-diamond") as diamond:  # fan-in join, a re-chunked streaming edge
        got = diamond.run({"x": X})
        for port, value in embedded["diamond"].items():
            torch.testing.assert_close(got[port], value, rtol=0, atol=1e-6, msg=port)


def test_http_routes_answer_through_the_ingress(embedded, ray_app):
    body = {"inputs": {"prompt": PROMPTS[1]}, "params": GREEDY}
    r = httpx.post(ray_app.url + "/v1/pipelines/tiny-llm/run", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"]["tokens"] == embedded["greedy"][1]
    # bad input is the same OpenAI-style 400 as embedded
    r = httpx.post(ray_app.url + "/v1/pipelines/tiny-llm/run", json={"inputs": {"promt": "x"}}, timeout=60)
    assert r.status_code == 400 and "promt" in r.json()["error"]["message"]


def test_streaming_arrives_in_chunks_while_generating(ray_app):
    # long enough (a thousand engine steps, dozens of relay intervals even on a fast machine)
    # that a relay holding chunks back would show
    body = {"model": "tiny-llm", "prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0, "stream": True}
    arrivals = []
    start = time.monotonic()
    with httpx.stream("POST", ray_app.url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    arrivals.append(time.monotonic() - start)
    # a steady flow leaves the replica at most every relay interval (20 ms), so several
    # tokens may share an event: the count is not the token count
    assert len(arrivals) >= 10, arrivals
    # the first text leaves long before the last, and the rest arrive spread over the
    # generation: chunks are relayed as they are made, not held until the end
    assert arrivals[0] < 0.5 * arrivals[-1], arrivals
    spread = [t for t in arrivals if t < (arrivals[0] + arrivals[-1]) / 2]
    assert len(spread) >= 10, arrivals


def _llm_idle(stats: dict) -> bool:
    return stats["running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_cancel_frees_the_engine(ray_app):
    with ray_app.pipeline("tiny-llm") as llm:
        before = llm.stage_stats()["llm"]
        assert _llm_idle(before), before

        async def leave_after_three():
            n = 0
            async for chunk in llm.stream({"prompt": PROMPTS[2]}, LONG):
                n += chunk.port == "tokens"
                if n == 3:
                    return n

        assert asyncio.run(leave_after_three()) == 3
        end = time.monotonic() + 30
        while not _llm_idle(stats := llm.stage_stats()["llm"]):
            assert time.monotonic() < end, f"the engine still holds the cancelled request: {stats}"
            time.sleep(0.1)
        time.sleep(0.5)
        generated = llm.stage_stats()["llm"]["generated_tokens"] - before["generated_tokens"]
        assert 3 <= generated < 1000, generated  # stopped long before its 2000 tokens
        assert llm.request_counts["cancelled"] == 1


def _kill_llm_engine(llm) -> tuple[str, int]:
    """SIGKILL the engine process of the llm replica (as the kernel's OOM killer would): the
    replica must end with it. Returns the replica's id and process id."""
    stats = llm.replica_stats()["llm"][0]
    assert stats["pid"] != stats["replica_pid"], "the engine runs in the replica's own process"
    os.kill(stats["pid"], signal.SIGKILL)
    return stats["replica_id"], stats["replica_pid"]


def test_a_killed_replica_fails_only_its_requests_and_is_replaced(embedded, ray_app):
    llm, diamond = ray_app.pipeline("tiny-llm"), ray_app.pipeline("tiny-diamond")
    results: dict = {}

    async def long_llm(started: threading.Event):
        try:
            async for _chunk in llm.stream({"prompt": PROMPTS[0]}, LONG):
                started.set()
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            results["llm"] = exc

    def slow_diamond():  # another deployment's request, in flight across the kill
        results["diamond"] = diamond.run({"x": X}, {"producer": {"delay": 0.5}})

    try:
        started = threading.Event()
        llm_thread = threading.Thread(target=lambda: asyncio.run(long_llm(started)))
        llm_thread.start()
        assert started.wait(60)
        diamond_thread = threading.Thread(target=slow_diamond)
        diamond_thread.start()
        killed, replica_pid = _kill_llm_engine(llm)
        llm_thread.join(60)
        diamond_thread.join(60)
        assert isinstance(results.get("llm"), WorkerDiedError), results.get("llm")
        end = time.monotonic() + 30
        while pid_exists(replica_pid) and time.monotonic() < end:
            time.sleep(0.1)
        assert not pid_exists(replica_pid), "the replica outlived its engine process"
        for port, value in embedded["diamond"].items():
            torch.testing.assert_close(results["diamond"][port], value, rtol=0, atol=1e-6, msg=port)

        # /ready shows the stage down until Serve's replacement has built its engine
        seen_down, end = False, time.monotonic() + 180
        while True:
            r = httpx.get(ray_app.url + "/ready", timeout=10)
            if r.status_code == 503:
                seen_down = seen_down or r.json()["pipelines"]["tiny-llm"]["stages"]["llm"]["ready"] is False
            elif seen_down:
                break
            assert time.monotonic() < end, "the killed replica was not replaced"
            time.sleep(0.1)
        assert r.json()["pipelines"]["tiny-llm"]["stages"]["llm"]["ready"] is True
        assert llm.run({"prompt": PROMPTS[3]}, GREEDY)["tokens"] == embedded["greedy"][3]
        assert llm.replica_stats()["llm"][0]["replica_id"] != killed
    finally:
        llm.close(0)
        diamond.close(0)


def test_a_full_edge_holds_back_its_producer(ray_app, tmp_path):
    """pre -> sleeper has max_inflight 1: with three requests at once, the sleeper's replica
    never holds more than one (the driver keeps the others before `pre`)."""
    from ray import serve

    from omnistage.ray_serve.app import build_app

    path = tmp_path / "sleepy.yaml"
    path.write_text(SMALL_YAML)  # pre -> sleeper -> copy, the runtime tests' pipeline
    app = build_app({"configs": [str(path)], "options": {"cpus_per_thread": 0.0}})
    serve.run(app, name="sleepy", route_prefix=None, blocking=False, logging_config={"enable_access_log": False})
    sleepy = ray_app.pipeline(str(path), app="sleepy")
    try:
        done = []
        threads = [
            threading.Thread(
                target=lambda: done.append(sleepy.run({"x": torch.ones(2)}, {"sleeper": {"delay": 0.6}}, timeout=60))
            )
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        most_in_sleeper, seen_one = 0, False
        while any(t.is_alive() for t in threads):
            stats = sleepy.stage_stats(timeout=5)["sleeper"]
            held = stats.get("inflight", 0) + stats.get("queue_depth", 0)
            most_in_sleeper = max(most_in_sleeper, held)
            seen_one = seen_one or held == 1
            time.sleep(0.02)
        assert len(done) == 3 and all(torch.equal(d["y"], torch.ones(2)) for d in done)
        assert seen_one, "never saw the sleeper working"
        assert most_in_sleeper <= 1, "the edge let more than max_inflight requests through"
    finally:
        sleepy.close(0)
        serve.delete("sleepy")


def test_bench_quick_through_the_running_cluster(ray_app):
    """`omnistage bench runtime --backend ray --quick` (its own Serve application beside this
    module's): Ray's tokens equal embedded ones, and each figure comes from both systems."""
    from omnistage.bench.ray_runtime import run_bench

    result = run_bench(quick=True, runs=1, progress=False)
    assert result["outputs_equal"] is True
    ray_tps, emb_tps = result["ray"]["throughput_tok_s"], result["embedded"]["throughput_tok_s"]
    assert ray_tps > 0 and emb_tps > 0
    assert result["ratios"]["ray_vs_embedded_throughput"] == pytest.approx(ray_tps / emb_tps)
    reference = result["reference"]
    overhead = reference["ray_run_ms_p50"]["median"] - reference["embedded_run_ms_p50"]["median"]
    assert result["ray"]["request_overhead_ms_p50"] == pytest.approx(overhead)
    assert reference["ray_run_ms_p50"]["median"] > 0 and reference["embedded_run_ms_p50"]["median"] > 0
    assert reference["chunks_per_request"] == 16  # the quick run's max_tokens, one chunk each
    assert set(result["meets_targets"]) == {"ratios.ray_vs_embedded_throughput", "ray.request_overhead_ms_p50"}


def test_the_cli_serves_on_a_running_cluster(ray_app, tmp_path):
    """`omnistage serve --backend ray` with RAY_ADDRESS set: it deploys its application on that
    cluster (replacing this module's, so this test comes last), serves it (its jobs store where
    its OMNISTAGE_JOBS_DIR says, which the cluster's processes never had), and on SIGTERM
    deletes the application and leaves the cluster running."""
    import ray
    from ray import serve

    jobs_dir = tmp_path / "jobs"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONSAFEPATH": "1"}
    env["OMNISTAGE_JOBS_DIR"] = str(jobs_dir)
    cmd = [sys.executable, "-m", "omnistage.serving.cli", "serve", "--backend", "ray", "tiny-llm"]
    cmd += ["--ray-cpus-per-thread", "0.2", "--log-level", "info"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    try:
        end = time.monotonic() + 180
        while True:  # the application now holds tiny-llm only
            assert proc.poll() is None, "".join(output)
            try:
                models = httpx.get(ray_app.url + "/v1/models", timeout=5).json()
                if [m["id"] for m in models.get("data", [])] == ["tiny-llm"] and ray_app.wait_ready(1):
                    break
            except (httpx.HTTPError, AssertionError, ValueError):
                pass
            assert time.monotonic() < end, "the CLI's application never came up"
            time.sleep(0.5)
        body = {"model": "tiny-llm", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        r = httpx.post(ray_app.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        job = {"model": "tiny-llm", "inputs": {"prompt": "hi"}, "params": {"llm": {"max_tokens": 2}}}
        r = httpx.post(ray_app.url + "/v1/jobs", json=job, timeout=60)
        assert r.status_code in (200, 201, 202), r.text
        end = time.monotonic() + 60
        while (status := httpx.get(f"{ray_app.url}/v1/jobs/{r.json()['id']}", timeout=10).json()["status"]) not in (
            "completed",
            "failed",
        ):
            assert time.monotonic() < end, status
            time.sleep(0.2)
        assert status == "completed" and any(jobs_dir.iterdir())  # the ingress got the CLI's setting
        # the ingress answers before serve.run has seen the replaced deployments go: a signal
        # before the CLI says it is serving is an early stop (exit 143)
        end = time.monotonic() + 120
        while not any("through Ray Serve" in line for line in output):
            assert time.monotonic() < end and proc.poll() is None, "".join(output)
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, "".join(output)
        assert "omnistage" not in serve.status().applications
        assert ray.is_initialized() and ray.cluster_resources()["CPU"] == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
