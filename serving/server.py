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

import logging
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import uvicorn

from omnistage.serving.registry import PipelineRegistry, default_config_paths

log = logging.getLogger("omnistage.serving")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signals drain the registry before stopping."""

    def __init__(self, config: uvicorn.Config, app, registry: PipelineRegistry, drain_timeout: float):
        super().__init__(config)
        self.app = app
        self.registry = registry
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None

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
            if self.registry.inflight == 0 or time.monotonic() >= self.drain_deadline:
                if self.registry.inflight:
                    log.warning("drain timeout: %d requests still in flight", self.registry.inflight)
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
) -> int:
    """Serve the pipelines in `configs` (default: every configs/tiny-*.yaml). Returns the exit
    status: 0 after a clean drain, 2 for invalid configs, 1 when the server could not start."""
    from omnistage.graph.loader import PipelineValidationError
    from omnistage.serving.app import create_app

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
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
    log.info("serving %s on http://%s:%d", ", ".join(registry.names()), host, port)

    app = create_app(registry, drain_timeout=drain_timeout)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=max(1.0, drain_timeout),
        access_log=False,
    )
    server = DrainingServer(config, app, registry, drain_timeout)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind the port
        return int(exc.code or 1)
    finally:
        registry.close(0.0)  # no-op for pipelines the app's shutdown already closed
    return 0 if server.started else 1
