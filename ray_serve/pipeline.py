"""RayPipeline: the Pipeline API (run, stream, generate, abort, readiness, stats, close) with
its requests routed through Serve deployments by a RayDriver instead of worker processes.

The serving layer, the jobs scheduler and the benchmarks call it exactly as they call the
embedded Pipeline: the methods are Pipeline's own, over the driver's Orchestrator surface.
"""

from __future__ import annotations

from typing import Any

from omnistage.graph.spec import PipelineSpec
from omnistage.ray_serve.driver import RayDriver
from omnistage.runtime.pipeline import Pipeline


class RayPipeline(Pipeline):
    def __init__(self, spec: PipelineSpec, handles: dict[str, Any], app_name: str):
        super().__init__(spec, RayDriver(spec, handles, app_name))

    @classmethod
    def connect(
        cls,
        spec: PipelineSpec,
        handles: dict[str, Any],
        app_name: str,
        *,
        wait_ready: bool = True,
        ready_timeout: float = 600,
    ) -> RayPipeline:
        """A started RayPipeline over `handles` (stage -> DeploymentHandle of app `app_name`)."""
        return cls(spec, handles, app_name)._start_and_wait(wait_ready, ready_timeout)

    @property
    def shm_prefix(self) -> str:
        raise AttributeError("a RayPipeline's tensors travel in Ray's object store, not in shared memory")

    def worker_pids(self) -> dict[str, list[int | None]]:
        """Serve owns the replicas' processes: see `replica_stats()` for each one's pid."""
        return {stage: [] for stage in self.spec.stages}

    def __repr__(self) -> str:
        return f"RayPipeline({self.name!r}, stages={list(self.spec.stages)}, ready={self.ready})"
