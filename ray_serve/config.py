"""`omnistage ray-config CONFIG... > serve.yaml`: the Serve config file of the application.

The file is what `serve run serve.yaml`, `serve deploy serve.yaml` and a KubeRay RayService's
`serveConfigV2` accept: one application whose `import_path` is ray_serve/app.py's `build_app`
with the pipeline files and overrides as `args`, and every deployment written out with the
options the YAML implies (num_replicas or autoscaling_config, ray_actor_options, the pinned
request router), so an operator reads and edits them in one place.
"""

from __future__ import annotations

import io
from typing import Any

from omnistage.ray_serve.options import (
    BackendOptions,
    PipelineSource,
    ingress_options,
    stage_options,
)

APP_NAME = "omnistage"
IMPORT_PATH = "omnistage.ray_serve.app:build_app"
ROUTER_PATH = "omnistage.ray_serve.router:PinnedRouter"  # router.py's, without importing ray


def serve_config(
    configs: list[str],
    overrides: list[str] = (),
    opts: BackendOptions | None = None,
    *,
    host: str = "0.0.0.0",
    port: int = 8000,
) -> dict[str, Any]:
    """The config as a dict (validates every pipeline file first: PipelineValidationError)."""
    opts = opts or BackendOptions()
    source = PipelineSource.resolve(list(configs), list(overrides))
    deployments = []
    for spec in source.load_all():
        for stage in spec.stages:
            options = stage_options(spec, stage, opts)
            options["request_router_config"] = {"request_router_class": ROUTER_PATH}
            deployments.append(options)
    deployments.append(ingress_options(opts))
    # API keys never go into a file: replicas read OMNISTAGE_API_KEYS (set it in the runtime_env)
    options = {k: v for k, v in opts.to_dict().items() if k not in ("api_keys", "ingress_env")}
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": host, "port": port},
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                # Serve logs every call between deployments at INFO otherwise
                "logging_config": {"enable_access_log": False},
                "args": {"configs": source.configs, "overrides": source.overrides, "options": options},
                "deployments": deployments,
            }
        ],
    }


def dump_yaml(config: dict[str, Any]) -> str:
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.default_flow_style = False
    out = io.StringIO()
    yaml.dump(config, out)
    return out.getvalue()
