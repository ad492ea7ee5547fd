"""What a local Ray's CPUs hold: `omnistage serve --backend ray` fits its replicas to them by
default, and refuses, saying what would fit, when --ray-cpus-per-thread asks for more (the
replicas that did not fit used to wait to be scheduled forever, and Ctrl+C did not stop them)."""

from __future__ import annotations

import os
import subprocess
import sys

from omnistage.graph.loader import load_pipeline
from omnistage.ray_serve.options import BackendOptions, cpu_reservation, cpu_shortfall, fitting_cpus_per_thread


def test_the_reservation_counts_every_replicas_threads_and_the_ingress():
    specs = [load_pipeline("tiny-llm"), load_pipeline("tiny-image", overrides=["stages.denoiser.pool.replicas=2"])]
    opts = BackendOptions(cpus_per_thread=1.0, ingress_replicas=2, ingress_cpus=0.25)
    reservation = cpu_reservation(specs, opts)
    threads = sum(s.pool.threads * s.pool.replicas for spec in specs for s in spec.stages.values())
    assert reservation.threads == threads == 5
    assert reservation.cpus == 5.5
    assert cpu_shortfall(reservation, 6.0, opts) is None
    fitting = fitting_cpus_per_thread(reservation, 2.0)
    assert fitting == 0.3  # 1.5 CPUs left by the ingress over 5 threads
    assert f"--ray-cpus-per-thread {fitting:g}" in cpu_shortfall(reservation, 2.0, opts)
    assert cpu_shortfall(cpu_reservation(specs, BackendOptions(fitting, 2, 0.25)), 2.0, opts) is None


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
