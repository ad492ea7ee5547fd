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
    fitting_cpus_per_thread,
    reservation,
    shortfall,
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
    # without RAY_ADDRESS a new local Ray, never a `ray start` cluster found on this machine
    ray.init(address=address or "local", num_cpus=None if address else os.cpu_count(), include_dashboard=False)
    missing = _fit_cpus(source.load_all(), opts, ray.cluster_resources(), fit_cpus and not address)
    if missing is not None and not address:  # a local Ray gains no nodes: refuse
        ray.shutdown()
        print(f"omnistage serve --backend ray: {missing}", file=sys.stderr)
        return 2
    if missing is not None:  # a cluster's autoscaler may add nodes
        log.warning("%s", missing)
    try:
        return _deploy_until_stopped(source, opts, host, port, log_level)
    finally:
        if not address:
            from ray import serve

            serve.shutdown()
        ray.shutdown()


def _fit_cpus(specs: list, opts: BackendOptions, cluster: dict[str, float], fit: bool) -> str | None:
    """With `fit`, lowers opts.cpus_per_thread until the replicas (an autoscaled pool's most
    included) fit the cluster's CPUs; returns what to say when they still do not fit."""
    res = reservation(specs, opts)
    cpus = cluster.get("CPU", 0.0)
    fitting = fitting_cpus_per_thread(res, cpus)
    if fit and fitting > 0 and res.max_threads * opts.cpus_per_thread + res.ingress_cpus > cpus:
        opts.cpus_per_thread = min(opts.cpus_per_thread, fitting)
        log.info("%d pool threads on %g CPUs: each reserves %g of a Ray CPU", res.max_threads, cpus, fitting)
    return shortfall(res, cluster, opts)


def _deploy_until_stopped(source: PipelineSource, opts: BackendOptions, host: str, port: int, log_level: str) -> int:
    """Run the application until SIGINT/SIGTERM, then delete it. Deploying runs in a thread
    (serve.run waits for every replica, maybe for ever), so a signal stops the wait without
    interrupting Ray's own code. Returns 0, or 128 + the signal when it came before the
    application was ready; a second signal gives up on the deletion too."""
    from ray import serve

    from omnistage.ray_serve.app import build_app
    from omnistage.runtime.threads import start_background_thread
    from omnistage.serving import interrupts

    signals: list[int] = []
    stop, done = threading.Event(), threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        signals.append(signum)
        stop.set()
        if len(signals) > 1:
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    interrupts.raise_if_interrupted()  # a Ctrl+C that the imports swallowed
    failed: list[BaseException] = []

    def deploy() -> None:
        try:
            serve.start(http_options={"host": host, "port": port})
            args: dict[str, Any] = {**source.to_dict(), "options": opts.to_dict()}
            # Serve logs every call between deployments at INFO: only with --log-level debug
            logging_config = {"log_level": log_level.upper(), "enable_access_log": log_level == "debug"}
            serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False, logging_config=logging_config)
        except BaseException as exc:  # noqa: BLE001 - raised again in the main thread
            failed.append(exc)
        finally:
            done.set()

    start_background_thread(deploy, "omnistage-deploy")
    while not (stop.wait(0.1) or done.is_set()):
        pass
    if failed and not stop.is_set():
        raise failed[0]
    status = 128 + signals[0] if signals and not done.is_set() else 0
    if status:
        log.warning("stopped before the application was ready")
    else:
        log.info("serving %s on http://%s:%d through Ray Serve", ", ".join(source.configs), host, port)
        while not stop.wait(0.5):
            pass
    log.info("stopping: deleting the Serve application")
    serve.delete(APP_NAME)
    return status
