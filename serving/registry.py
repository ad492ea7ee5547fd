"""PipelineRegistry: the pipelines one server hosts, their load state, and the drain flag.

The server parses every config up front (bad YAML fails before the port opens), then loads the
pipelines in a background thread so /health answers while workers start. Routers reach the
registry as `request.app.state.registry` (see serving/deps.py) and ask it for a ready pipeline
by name.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistage.errors import OmnistageError
from omnistage.serving.errors import ModelNotFoundError, ServiceUnavailableError
from omnistage.serving.warmup import warm_serving

log = logging.getLogger("omnistage.serving")

LOADING, READY, FAILED, CLOSED = "loading", "ready", "failed", "closed"
STAGE_POLL_S = 0.25  # how often loading stages are checked for the per-stage log lines
PROGRESS_EVERY_S = 15.0  # a "still loading" line this often while a pipeline loads


@dataclass
class PipelineEntry:
    name: str
    spec: Any  # omnistage.graph.spec.PipelineSpec (None when added as a built pipeline)
    source: str = ""
    state: str = LOADING
    pipeline: Any = None  # omnistage.runtime.pipeline.Pipeline once constructed
    error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    load_seconds: float | None = None

    @property
    def effective_spec(self) -> Any:
        """The parsed spec, or the built pipeline's own when it was added built (None without either)."""
        return self.spec if self.spec is not None else getattr(self.pipeline, "spec", None)

    @property
    def stage_names(self) -> list[str]:
        spec = self.effective_spec
        return list(spec.stages) if spec is not None else []

    def is_ready(self) -> bool:
        return self.state == READY and self.pipeline is not None and bool(self.pipeline.ready)

    def describe(self) -> dict[str, Any]:
        """Readiness detail for /ready: the pipeline's state and each stage's."""
        # local state of the runtime (every replica of the stage ready): asks no worker
        stage_ready = self.pipeline.stage_ready() if self.pipeline is not None else {}
        ready = self.is_ready()
        stages = {name: {"ready": stage_ready.get(name, ready)} for name in self.stage_names}
        out: dict[str, Any] = {"ready": ready, "state": self.state, "stages": stages}
        if self.error:
            out["error"] = self.error
        if self.load_seconds is not None:
            out["load_seconds"] = round(self.load_seconds, 3)
        return out


def config_stem(config: str | Path) -> str:
    """`configs/tiny-llm.yaml` and the bare name `tiny-llm` both give `tiny-llm`."""
    name = Path(str(config)).name
    for suffix in (".yaml", ".yml"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def overrides_per_config(configs: list[str | Path], overrides: Iterable[str]) -> list[list[str]]:
    """Split `--set` overrides between configs.

    `PATH=VALUE` applies to every config; `STEM:PATH=VALUE` only to the config whose file stem
    is STEM (`tiny-llm:stages.llm.pool.threads=2`), so one serve command can tune stages that
    exist in only one of its pipelines. A scope naming no config is an error (ValueError).
    """
    stems = [config_stem(c) for c in configs]
    out: list[list[str]] = [[] for _ in configs]
    for text in overrides:
        path = text.partition("=")[0]
        scope, colon, rest = path.partition(":")
        if not colon:
            for own in out:
                own.append(text)
            continue
        if scope not in stems:
            raise ValueError(
                f"override {text!r} is scoped to {scope!r}, which is none of the configs served ({', '.join(stems)})"
            )
        for stem, own in zip(stems, out):
            if stem == scope:
                own.append(text[len(scope) + 1 :])
    return out


class PipelineRegistry:
    def __init__(self, *, ready_timeout: float = 600.0, pipeline_factory: Any = None):
        self._entries: dict[str, PipelineEntry] = {}
        # spec -> started Pipeline-like object (None: the embedded runtime's Pipeline.from_spec);
        # the Ray backend passes one that routes through Serve deployments instead
        self.pipeline_factory = pipeline_factory
        self._lock = threading.Lock()
        self._loader: threading.Thread | None = None
        self._closing = threading.Event()
        self.ready_timeout = ready_timeout
        self.draining = False
        self.inflight = 0  # HTTP requests doing work; touched only on the event loop
        self.work_tasks: set[asyncio.Task] = set()  # their tasks (event loop only)
        self.cutting = False  # the drain timeout passed: in-flight requests are being cut
        self.started_at = time.time()
        self.on_loaded: Callable[[], None] | None = None  # called once every pipeline has loaded or failed

    # -- building ----------------------------------------------------------------------------
    @classmethod
    def from_configs(cls, configs: Iterable[str | Path], overrides: Iterable[str] = (), **kwargs) -> PipelineRegistry:
        """Parse and validate every config now (raises PipelineValidationError); load later."""
        from omnistage.graph.loader import load_pipeline

        registry = cls(**kwargs)
        configs = list(configs)
        for config, own in zip(configs, overrides_per_config(configs, overrides)):
            spec = load_pipeline(config, overrides=own)
            registry.add_spec(spec, source=str(config))
        return registry

    def add_spec(self, spec: Any, source: str = "") -> PipelineEntry:
        with self._lock:
            if spec.name in self._entries:
                raise ValueError(
                    f"two pipelines are named {spec.name!r} ({source} and {self._entries[spec.name].source})"
                )
            entry = PipelineEntry(name=spec.name, spec=spec, source=source)
            self._entries[spec.name] = entry
            return entry

    def add_pipeline(self, pipeline: Any) -> PipelineEntry:
        """Host an already-constructed Pipeline (embedding, tests). The registry closes it."""
        with self._lock:
            if pipeline.name in self._entries:
                raise ValueError(f"a pipeline named {pipeline.name!r} is already registered")
            entry = PipelineEntry(
                name=pipeline.name,
                spec=getattr(pipeline, "spec", None),
                source="<object>",
                pipeline=pipeline,
                state=READY,
            )
            self._entries[pipeline.name] = entry
            return entry

    # -- loading -----------------------------------------------------------------------------
    def start_loading(self) -> None:
        """Start every not-yet-built pipeline in a background thread (idempotent)."""
        if self._loader is not None or not any(e.pipeline is None for e in self._entries.values()):
            return
        self._loader = threading.Thread(target=self._load_all, name="omnistage-loader", daemon=True)
        self._loader.start()

    def _load_all(self) -> None:
        from omnistage.runtime.pipeline import Pipeline

        factory = self.pipeline_factory or Pipeline.from_spec
        pending = [e for e in self._entries.values() if e.pipeline is None and e.state == LOADING]
        # Start every pipeline's workers first so they boot in parallel, then wait for each in
        # its own thread so each turns ready (and reports its load time) as soon as it is.
        waiters = []
        for entry in pending:
            if self._closing.is_set():
                return
            started = time.monotonic()
            try:
                pipeline = factory(entry.spec, start=True, wait_ready=False)
            except Exception as exc:  # noqa: BLE001 - reported on /ready
                self._fail(entry, exc)
                continue
            with self._lock:
                closing = self._closing.is_set()
                if not closing:
                    entry.pipeline = pipeline
            if closing:  # close() ran while this one was being built: it is ours to close
                _close_quietly(pipeline, 0.0)
                return
            waiter = threading.Thread(
                target=self._wait_ready, args=(entry, started), name=f"omnistage-ready-{entry.name}", daemon=True
            )
            waiter.start()
            waiters.append(waiter)
        for waiter in waiters:
            waiter.join()
        if self.on_loaded is not None and not self._closing.is_set():
            self.on_loaded()

    def _wait_ready(self, entry: PipelineEntry, started: float) -> None:
        try:
            self._watch_stages(entry, started)
        except Exception as exc:  # noqa: BLE001
            if not self._closing.is_set():
                self._fail(entry, exc)
            return
        spec = entry.effective_spec
        if spec is not None:
            warm_serving(spec)  # before READY: no request waits for the first encode's imports
        if self._closing.is_set():
            return
        entry.load_seconds = time.monotonic() - started
        entry.state = READY
        log.info("pipeline %r ready in %.1fs", entry.name, entry.load_seconds)

    def _watch_stages(self, entry: PipelineEntry, started: float) -> None:
        """Wait for the pipeline, logging one line per stage as it turns ready and a progress
        line while stages take long (building a tiny checkpoint, loading large weights)."""
        pipeline, end = entry.pipeline, started + self.ready_timeout
        stages = entry.spec.stages if entry.spec is not None else {}
        seen: set[str] = set()
        next_note = started + PROGRESS_EVERY_S
        while True:
            try:
                pipeline.wait_ready(min(STAGE_POLL_S, max(0.0, end - time.monotonic())))
                done = True
            except TimeoutError:
                if time.monotonic() >= end:
                    raise
                done = False
            now = time.monotonic()
            for name, ready in pipeline.stage_ready().items():
                if (ready or done) and name not in seen:
                    seen.add(name)
                    note = _stage_note(stages.get(name))
                    log.info("%s/%s%s: ready after %.1fs", entry.name, name, note, now - started)
            if done or self._closing.is_set():
                return
            if now >= next_note:
                waiting = [n for n in pipeline.stage_ready() if n not in seen]
                log.info("%s: still loading %s (%.0fs)", entry.name, ", ".join(waiting), now - started)
                next_note = now + PROGRESS_EVERY_S

    def _fail(self, entry: PipelineEntry, exc: Exception) -> None:
        entry.state = FAILED
        entry.error = f"{exc.__class__.__name__}: {exc}"
        log.error("pipeline %r failed to load: %s", entry.name, entry.error)

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the loader thread finished (tests, `serve --wait`)."""
        if self._loader is not None:
            self._loader.join(timeout)
            return not self._loader.is_alive()
        return True

    # -- queries -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[PipelineEntry]:
        return list(self._entries.values())

    def entry(self, name: str) -> PipelineEntry | None:
        return self._entries.get(name)

    def pipelines(self) -> dict[str, Any]:
        """name -> Pipeline for every constructed pipeline (loading ones included)."""
        return {
            e.name: e.pipeline for e in self._entries.values() if e.pipeline is not None and e.state in (LOADING, READY)
        }

    @property
    def ready(self) -> bool:
        entries = self.entries()
        return bool(entries) and not self.draining and all(e.is_ready() for e in entries)

    def readiness(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "draining": self.draining,
            "pipelines": {e.name: e.describe() for e in self.entries()},
        }

    def get(self, name: str) -> Any:
        """The ready Pipeline called `name`, or the error the client should see."""
        if self.draining:
            raise ServiceUnavailableError("The server is shutting down; retry on another replica.", code="draining")
        entry = self._entries.get(name)
        if entry is None:
            raise ModelNotFoundError(name, self.names())
        if entry.state == FAILED:
            raise ServiceUnavailableError(f"The model {name!r} failed to load: {entry.error}", code="model_failed")
        # once loaded, a replica restarting after a worker's death does not refuse requests:
        # the runtime holds their deliveries until it is back (bounded by the intake limit)
        if entry.state != READY or entry.pipeline is None:
            raise ServiceUnavailableError(f"The model {name!r} is still loading.", code="model_loading")
        return entry.pipeline

    # -- shutdown ----------------------------------------------------------------------------
    def begin_drain(self) -> None:
        self.draining = True

    def cut_inflight(self) -> int:
        """Cancel every in-flight HTTP request (on the event loop, after the drain timeout):
        each is answered 503 `draining` by the middleware and its pipeline work is aborted."""
        self.draining = self.cutting = True
        tasks = [t for t in self.work_tasks if not t.done()]
        for task in tasks:
            task.cancel()
        return len(tasks)

    def close(self, drain_timeout: float = 30.0) -> None:
        """Close every pipeline (in parallel), letting their in-flight work finish first."""
        self.draining = True
        with self._lock:
            self._closing.set()
            entries = [e for e in self._entries.values() if e.pipeline is not None and e.state != CLOSED]
            for e in entries:
                e.state = CLOSED
        threads = [
            threading.Thread(target=_close_quietly, args=(e.pipeline, drain_timeout), name=f"close-{e.name}")
            for e in entries
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._loader is not None:
            self._loader.join(timeout=30.0)  # it closes a pipeline it was still building


def _stage_note(stage: Any) -> str:
    """` (ar_lm, tiny:tiny-llm)` for a stage's ready line."""
    if stage is None:
        return ""
    return f" ({stage.kind}, {stage.model.source})" if stage.model is not None else f" ({stage.kind})"


def _close_quietly(pipeline: Any, drain_timeout: float) -> None:
    try:
        pipeline.close(drain_timeout=drain_timeout)
    except Exception:  # noqa: BLE001 - shutting down: log, keep closing the others
        log.exception("closing pipeline %r failed", getattr(pipeline, "name", "?"))


__all__ = ["PipelineRegistry", "PipelineEntry", "OmnistageError"]
