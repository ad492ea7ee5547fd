"""`omnistage serve`: host pipelines behind FastAPI on uvicorn, with a graceful drain.

Order of events:
1. every config is parsed and validated (errors -> exit 2 before the port opens);
2. uvicorn starts; the app's startup begins loading pipelines in a background thread, so
   /health answers at once and /ready turns 200 when every stage is ready;
3. SIGTERM/SIGINT starts the drain: new work gets 503 (probes still answer), in-flight
   requests run to completion for up to `drain_timeout` seconds, then uvicorn stops and the
   pipelines are closed (no worker process or shared-memory segment left), exit status 0.
   A second SIGINT/SIGTERM skips the wait.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import uvicorn

from omnistage.graph.paths import default_config_paths
from omnistage.runtime.third_party_output import quiet_for_log_level
from omnistage.serving import interrupts
from omnistage.serving.registry import PipelineRegistry

log = logging.getLogger("omnistage.serving")

# after the drain timeout cancels the requests still running, how long their 503s may take
CUT_GRACE_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signals drain the registry before stopping."""

    def __init__(self, config: uvicorn.Config, app, registry: PipelineRegistry, drain_timeout: float):
        super().__init__(config)
        self.app = app
        self.registry = registry
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None
        self.cut_deadline: float | None = None  # set when the drain timeout cut requests

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:  # said once the port is bound (uvicorn exits when it cannot bind)
            log.info("serving %s on http://%s:%d", ", ".join(self.registry.names()), self.config.host, self.config.port)

    def handle_exit(self, sig: int, frame) -> None:
        # Unlike uvicorn's own handler this does not record the signal for re-raising at the
        # end, so a drained shutdown exits with status 0.
        if self.drain_deadline is None:
            log.info(
                "received %s: draining (up to %.0fs for %d in-flight requests)",
                signal.Signals(sig).name,
                self.drain_timeout,
                self.registry.inflight,
            )
            self.registry.begin_drain()
            self.drain_deadline = time.monotonic() + self.drain_timeout
        else:
            log.warning("second %s: stopping now", signal.Signals(sig).name)
            self.should_exit = True
            self.force_exit = True

    def remaining_drain(self) -> float:
        if self.drain_deadline is None:
            return self.drain_timeout
        return max(0.0, self.drain_deadline - time.monotonic())

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            now = time.monotonic()
            if self.registry.inflight and now >= self.drain_deadline and self.cut_deadline is None:
                cut = self.registry.cut_inflight()
                log.warning("drain timeout: answering %d unfinished requests with 503 draining", cut)
                self.cut_deadline = now + CUT_GRACE_S
            if self.registry.inflight == 0 or (self.cut_deadline is not None and now >= self.cut_deadline):
                self.should_exit = True
                # What is left of the budget goes to uvicorn's connection wait and the close.
                self.config.timeout_graceful_shutdown = max(1.0, self.remaining_drain())
                self.app.state.drain_timeout = max(1.0, self.remaining_drain())
        return await super().on_tick(counter)


def serve(
    configs: Iterable[str | Path] = (),
    host: str = "127.0.0.1",
    port: int = 8000,
    overrides: Iterable[str] = (),
    drain_timeout: float = 30.0,
    *,
    log_level: str = "info",
    ready_timeout: float = 600.0,
    max_body_bytes: int | None = None,
    allowed_hosts: Iterable[str] = (),
    api_keys: Iterable[str] = (),
    max_concurrent_per_key: int | None = None,
) -> int:
    """Serve the pipelines in `configs` (default: every configs/tiny-*.yaml). Returns the exit
    status: 0 after a clean drain, 2 for invalid configs, 1 when the server could not start."""
    from omnistage.graph.loader import PipelineValidationError
    from omnistage.serving.app import create_app
    from omnistage.serving.auth import ApiKeyPolicy
    from omnistage.serving.guards import DEFAULT_MAX_BODY_BYTES, HostPolicy, is_loopback

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    quiet_for_log_level(log_level)
    if not _environment_ok():
        return 2
    paths = list(configs) or default_config_paths()
    if not paths:
        print("omnistage serve: no pipeline configs given and no configs/tiny-*.yaml found", file=sys.stderr)
        return 2
    try:
        registry = PipelineRegistry.from_configs(paths, overrides, ready_timeout=ready_timeout)
    except PipelineValidationError as err:
        for line in err.problems:
            print(line, file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:
        print(f"omnistage serve: {err}", file=sys.stderr)
        return 2
    registry.on_loaded = freeze_heap

    host_policy = HostPolicy.for_bind(host, allowed_hosts)
    auth = ApiKeyPolicy.from_sources(api_keys, max_concurrent_per_key)
    if not is_loopback(host) and auth is None:
        log.warning(
            "listening on %s, not a loopback address, with no authentication (no --api-key or "
            "OMNISTAGE_API_KEYS): anyone who can reach this port can run its pipelines",
            host,
        )
    app = create_app(
        registry,
        drain_timeout=drain_timeout,
        max_body_bytes=DEFAULT_MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes,
        host_policy=host_policy,
        api_keys=auth,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        loop="uvloop",  # both dependencies: per streamed token the event loop and the
        http="httptools",  # HTTP writer are most of the server's own work
        lifespan="on",
        timeout_graceful_shutdown=max(1.0, drain_timeout),
        access_log=False,
    )
    server = DrainingServer(config, app, registry, drain_timeout)
    try:
        interrupts.raise_if_interrupted()  # a Ctrl+C during the imports above that was swallowed
        server.run()
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind the port
        return int(exc.code or 1)
    finally:
        registry.close(0.0)  # no-op for pipelines the app's shutdown already closed
    return 0 if server.started else 1


def _environment_ok() -> bool:
    """Settings read from the environment later, by each session, are checked at start."""
    from omnistage.serving.realtime.early import preemptive_pause_ms

    try:
        preemptive_pause_ms()
    except ValueError as err:
        print(f"omnistage serve: {err}", file=sys.stderr)
        return False
    return True


def freeze_heap() -> None:
    """Move everything alive once the pipelines have loaded (torch, the app, the pipelines'
    clients) out of the garbage collector's reach. Otherwise each full collection scans all of
    it with the event loop stopped, a pause that lands on every request in flight (how long:
    docs/serving.md, Lifecycle)."""
    gc.collect()
    gc.freeze()
