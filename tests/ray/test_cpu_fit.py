"""What a local Ray's CPUs hold: `omnistage serve --backend ray` fits its replicas to them by
default, and refuses, saying what would fit, when --ray-cpus-per-thread asks for more (the
replicas that did not fit used to wait to be scheduled forever, and Ctrl+C did not stop them)."""

from __future__ import annotations

import os
import subprocess
import sys

from omnistage.graph.loader import load_pipeline
from omnistage.ray_serve.options import BackendOptions, fitting_cpus_per_thread, reservation, shortfall


def test_the_reservation_counts_every_replicas_threads_and_the_ingress():
    specs = [load_pipeline("tiny-llm"), load_pipeline("tiny-image", overrides=["stages.denoiser.pool.replicas=2"])]
    opts = BackendOptions(cpus_per_thread=1.0, ingress_replicas=2, ingress_cpus=0.25)
    res = reservation(specs, opts)
    threads = sum(s.pool.threads * s.pool.replicas for spec in specs for s in spec.stages.values())
    assert res.threads == res.max_threads == threads == 5
    assert res.cpus(1.0) == 5.5
    assert shortfall(res, {"CPU": 6.0}, opts) is None
    fitting = fitting_cpus_per_thread(res, 2.0)
    assert fitting == 0.3  # 1.5 CPUs left by the ingress over 5 threads
    assert f"--ray-cpus-per-thread {fitting:g}" in shortfall(res, {"CPU": 2.0}, opts)
    assert shortfall(res, {"CPU": 2.0}, BackendOptions(fitting, 2, 0.25)) is None


def test_autoscaled_pools_gpus_and_resources_are_counted():
    scaled = "stages.llm.pool.autoscaling={min_replicas: 0, max_replicas: 4}"
    llm = load_pipeline("tiny-llm", overrides=[scaled])
    res = reservation([llm], BackendOptions())
    assert (res.threads, res.max_threads) == (0, 4)  # Serve starts it at min_replicas
    assert fitting_cpus_per_thread(res, 2.0) == 0.5  # room for the replicas it may add
    gpu = load_pipeline(
        "tiny-llm", overrides=["stages.llm.pool.devices=[cuda:0]", "stages.llm.pool.resources={accel: 2}"]
    )
    res = reservation([gpu], BackendOptions())
    assert res.other == {"GPU": 1.0, "accel": 2.0}
    assert "1 of GPU (pools with a cuda device) and Ray has 0" in shortfall(res, {"CPU": 2.0}, BackendOptions())
    assert "'accel'" in shortfall(res, {"CPU": 2.0, "GPU": 1.0}, BackendOptions())
    assert shortfall(res, {"CPU": 2.0, "GPU": 1.0, "accel": 2.0}, BackendOptions()) is None


def test_serve_refuses_what_a_local_ray_cannot_schedule():
    env = {**os.environ, "PYTHONSAFEPATH": "1", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "omnistage.serving.cli", "serve", "--backend", "ray", "tiny-llm", "tiny-image"]
    cmd += ["--ray-cpus-per-thread", "4", "--port", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    cpus = os.cpu_count()
    assert f"reserves 16 Ray CPUs (4 pool threads x --ray-cpus-per-thread 4, plus the ingress) and Ray has {cpus}" in (
        done.stderr
    ), done.stderr[-2000:]
    assert f"Try --ray-cpus-per-thread {int(100 * cpus / 4) / 100:g}." in done.stderr
