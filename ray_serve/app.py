"""build_app: the pipelines of some YAML files as one Ray Serve application.

One deployment per stage pool (`PIPELINE.STAGE`, replicas of ray_serve/replica.py's
StageReplica) and the FastAPI app as the ingress deployment (`ingress`): every route of
`omnistage serve`, SSE and websockets included, answered by a PipelineRegistry whose pipelines
are RayPipelines over the stage deployments' handles. Several ingress replicas may run; each
has its own driver (jobs then need the shared PostgreSQL store, see docs/scale-out.md).

`build_app(args)` is also the `import_path` target of the Serve config that `omnistage
ray-config` writes: args are {"configs": [...], "overrides": [...], "options": {...}}.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from omnistage.ray_serve.config import ROUTER_PATH
from omnistage.ray_serve.options import (
    BackendOptions,
    PipelineSource,
    ingress_options,
    stage_options,
)
from omnistage.ray_serve.replica import StageReplica


class Ingress:
    """The FastAPI app of serving/app.py, its pipelines routed through the stage deployments."""

    def __init__(self, handles: dict[str, dict[str, Any]], source: dict, options: dict):
        from omnistage.ray_serve.pipeline import RayPipeline
        from omnistage.serving.auth import ApiKeyPolicy
        from omnistage.serving.registry import PipelineRegistry

        opts = BackendOptions.from_dict(options)
        app_name = serve.get_replica_context().app_name

        def connect(spec, *, start: bool = True, wait_ready: bool = False) -> RayPipeline:
            return RayPipeline.connect(spec, handles[spec.name], app_name, wait_ready=wait_ready)

        self.registry = PipelineRegistry(pipeline_factory=connect)
        src = PipelineSource.from_dict(source)
        for spec, config in zip(src.load_all(), src.configs):
            self.registry.add_spec(spec, source=config)
        self.opts = opts
        self.api_keys = ApiKeyPolicy.from_sources(opts.api_keys, None)

    def __serve_build_asgi_app__(self):
        from omnistage.serving.app import create_app

        return create_app(self.registry, drain_timeout=self.opts.drain_timeout, api_keys=self.api_keys)


def build_app(args: dict[str, Any]) -> serve.Application:
    """The Serve application for `args` (see the module docstring)."""
    source = PipelineSource.resolve(list(args["configs"]), list(args.get("overrides") or []))
    opts = BackendOptions.from_dict(args.get("options"))
    router = RequestRouterConfig(request_router_class=ROUTER_PATH)
    stage_cls = serve.deployment(StageReplica)
    handles: dict[str, dict[str, Any]] = {}
    for spec in source.load_all():
        handles[spec.name] = {
            stage: stage_cls.options(**stage_options(spec, stage, opts), request_router_config=router).bind(
                source.to_dict(), spec.name, stage, opts.to_dict()
            )
            for stage in spec.stages
        }
    ingress_cls = serve.deployment(serve.ingress()(Ingress))
    return ingress_cls.options(**ingress_options(opts)).bind(handles, source.to_dict(), opts.to_dict())
