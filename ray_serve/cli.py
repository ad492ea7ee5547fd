"""`omnistage serve --backend ray` and `omnistage ray-config` (serving/cli.py parses them).

`serve_on_ray` connects to the cluster at RAY_ADDRESS, or starts a local Ray with this
machine's CPUs, runs the application (stage deployments + the FastAPI ingress) with Serve's
HTTP proxy on HOST:PORT, and on SIGINT/SIGTERM deletes the application (and stops the local
Ray it started).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

from omnistage.ray_serve.config import APP_NAME, dump_yaml, serve_config
from omnistage.ray_serve.options import (
    BackendOptions,
    PipelineSource,
    cpu_reservation,
    cpu_shortfall,
    fitting_cpus_per_thread,
)

log = logging.getLogger("omnistage.ray_serve")


def _checked(configs: list[str], overrides: list[str]) -> PipelineSource | None:
    from omnistage.graph.loader import PipelineValidationError

    source = PipelineSource.resolve(configs, overrides)
    try:
        source.load_all()
    except PipelineValidationError as err:
        for line in err.problems:
            print(line, file=sys.stderr)
        return None
    except (OSError, ValueError) as err:
        print(f"omnistage: {err}", file=sys.stderr)
        return None
    return source


def ray_config_command(configs: list[str], overrides: list[str], opts: BackendOptions, host: str, port: int) -> int:
    if _checked(configs, overrides) is None:
        return 2
    sys.stdout.write(dump_yaml(serve_config(configs, overrides, opts, host=host, port=port)))
    return 0


def serve_on_ray(
    configs: list[str],
    host: str,
    port: int,
    overrides: list[str],
    opts: BackendOptions,
    log_level: str = "info",
    fit_cpus: bool = False,
) -> int:
    """Deploy and serve until SIGINT/SIGTERM. `fit_cpus`: on a local Ray, lower
    `opts.cpus_per_thread` until every replica fits its CPUs (no --ray-cpus-per-thread given)."""
    from omnistage.graph.paths import default_config_paths
    from omnistage.runtime.third_party_output import quiet_for_log_level

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO))
    quiet_for_log_level(log_level)  # replicas inherit the driver's environment
    configs = list(configs) or [str(p) for p in default_config_paths()]
    source = _checked(configs, overrides)
    if source is None:
        return 2
    try:
        import ray
    except ImportError:
        print("omnistage serve --backend ray: install the ray extra (pip install 'omnistage[ray]')", file=sys.stderr)
        return 2

    # the jobs store settings (--jobs-db sets OMNISTAGE_JOBS_DB) reach the ingress replicas
    # on every node, not only those that inherit this process's environment
    opts.ingress_env = {k: v for k, v in os.environ.items() if k.startswith("OMNISTAGE_JOBS_")}
    address = os.environ.get("RAY_ADDRESS")
    ray.init(address=address or None, num_cpus=None if address else os.cpu_count(), include_dashboard=False)
    shortfall = _fit_cpus(source.load_all(), opts, ray.cluster_resources().get("CPU", 0.0), fit_cpus and not address)
    if shortfall is not None and not address:  # a local Ray gains no nodes: refuse
        ray.shutdown()
        print(f"omnistage serve --backend ray: {shortfall}", file=sys.stderr)
        return 2
    if shortfall is not None:  # a cluster's autoscaler may add nodes
        log.warning("%s", shortfall)
    try:
        return _deploy_until_stopped(source, opts, host, port, log_level)
    finally:
        if not address:
            from ray import serve

            serve.shutdown()
        ray.shutdown()


def _fit_cpus(specs: list, opts: BackendOptions, cpus: float, fit: bool) -> str | None:
    """With `fit`, lowers opts.cpus_per_thread until the replicas fit `cpus`; returns what to
    say when they still do not (None: they fit)."""
    reservation = cpu_reservation(specs, opts)
    fitting = fitting_cpus_per_thread(reservation, cpus)
    if fit and reservation.cpus > cpus and fitting > 0:
        opts.cpus_per_thread = fitting
        log.info("%d pool threads on %g CPUs: each reserves %g of a Ray CPU", reservation.threads, cpus, fitting)
    return cpu_shortfall(cpu_reservation(specs, opts), cpus, opts)


def _deploy_until_stopped(source: PipelineSource, opts: BackendOptions, host: str, port: int, log_level: str) -> int:
    """Run the application until SIGINT/SIGTERM, then delete it: 0, or 130 when stopped while
    it was still deploying (serve.run waits for every replica: the signal interrupts that)."""
    from ray import serve

    from omnistage.ray_serve.app import build_app

    stop, deploying = threading.Event(), threading.Event()

    def on_signal(*_: Any) -> None:
        stop.set()
        if deploying.is_set():
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    serve.start(http_options={"host": host, "port": port})
    args: dict[str, Any] = {**source.to_dict(), "options": opts.to_dict()}
    # Serve logs every call between deployments at INFO: only with --log-level debug
    logging_config = {"log_level": log_level.upper(), "enable_access_log": log_level == "debug"}
    status = 0
    deploying.set()
    try:
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False, logging_config=logging_config)
        deploying.clear()
        log.info("serving %s on http://%s:%d through Ray Serve", ", ".join(source.configs), host, port)
        stop.wait()
    except KeyboardInterrupt:
        log.warning("stopped before the application was ready")
        status = 130
    deploying.clear()
    log.info("stopping: deleting the Serve application")
    serve.delete(APP_NAME)
    return status
