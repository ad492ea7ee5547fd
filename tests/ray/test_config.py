"""`omnistage ray-config`: its output is a Serve config that Serve's own schema accepts, whose
import_path + args build (with Serve's own loader) exactly the deployments it configures, with
the options the pipeline YAML implies. No Ray cluster is needed for any of it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import yaml

AUTOSCALED = textwrap.dedent(
    """\
    name: scaled
    inputs: {prompt: text}
    outputs: {text: text}
    stages:
      llm:
        kind: ar_lm
        model: tiny:tiny-llm
        pool:
          devices: [cuda:0]
          threads: 2
          autoscaling: {min_replicas: 1, max_replicas: 4, initial_replicas: 2, target_ongoing_requests: 16}
          resources: {llm_node: 1}
    edges:
      - {from: inputs.prompt, to: llm.prompt}
      - {from: llm.text, to: outputs.text, stream: true}
    """
)


def ray_config(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    return subprocess.run(
        [sys.executable, "-m", "omnistage.serving.cli", "ray-config", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray-config") / "scaled.yaml"
    path.write_text(AUTOSCALED)
    run = ray_config("tiny-llm", "tiny-image", str(path), "--ray-cpus-per-thread", "0.5", "--port", "8123")
    assert run.returncode == 0, run.stderr
    return yaml.safe_load(run.stdout), path


def test_serve_schema_accepts_it(config):
    from ray.serve.schema import ServeDeploySchema

    doc, _ = config
    schema = ServeDeploySchema.model_validate(doc)
    assert schema.http_options.port == 8123
    (app,) = schema.applications
    assert app.import_path == "omnistage.ray_serve.app:build_app"
    names = [d.name for d in app.deployments]
    assert names == [
        "tiny-llm.llm",
        "tiny-image.text_encoder",
        "tiny-image.denoiser",
        "tiny-image.vae",
        "scaled.llm",
        "ingress",
    ]


def test_options_follow_the_pools(config):
    doc, path = config
    (app,) = doc["applications"]
    by_name = {d["name"]: d for d in app["deployments"]}
    assert by_name["tiny-llm.llm"]["num_replicas"] == 1
    llm = by_name["tiny-llm.llm"]["ray_actor_options"]
    assert llm["num_cpus"] == 0.5 and "num_gpus" not in llm
    assert llm["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "1"  # the pool's threads
    scaled = by_name["scaled.llm"]
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 2,
        "target_ongoing_requests": 16,
        "policy": {"policy_function": "omnistage.ray_serve.scaling:engine_requests_policy"},
    }
    actor = scaled["ray_actor_options"]
    assert (actor["num_cpus"], actor["num_gpus"], actor["resources"]) == (1.0, 1, {"llm_node": 1})
    assert actor["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "2"
    assert app["args"]["configs"] == ["tiny-llm", "tiny-image", str(path)]


def test_the_import_path_builds_the_configured_deployments(config):
    """What `serve run` / `serve deploy` do with the file: import the builder, call it with
    args, and match every configured deployment against the built application's."""
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app

    doc, _ = config
    (app,) = doc["applications"]
    application = call_user_app_builder_with_args_if_necessary(import_attr(app["import_path"]), app["args"])
    built = build_app(application, name=app["name"])
    built_names = {d.name for d in built.deployments}
    assert built_names == {d["name"] for d in app["deployments"]}
    scaled = next(d for d in built.deployments if d.name == "scaled.llm")
    scaling = scaled._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.initial_replicas) == (1, 4, 2)
    assert scaling.policy.get_policy().__name__ == "engine_requests_policy"
    assert scaled.ray_actor_options["num_gpus"] == 1
    router = scaled._deployment_config.request_router_config.request_router_class
    assert router.endswith("PinnedRouter")


def test_a_bad_autoscaling_block_is_a_file_line_col_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        AUTOSCALED.replace("initial_replicas: 2", "initial_replicas: 9").replace("llm_node: 1", "llm_node: x")
    )
    run = ray_config(str(bad))
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.strip().splitlines()
    text = bad.read_text().splitlines()
    row = next(i for i, t in enumerate(text) if "initial_replicas: 9" in t)
    col = text[row].index("initial_replicas: 9") + len("initial_replicas: ") + 1
    where = "stages.llm.pool"
    assert f"{bad}:{row + 1}:{col}: {where}.autoscaling: needs min_replicas <= initial_replicas" in lines[0]
    row = next(i for i, t in enumerate(text) if "llm_node: x" in t)
    col = text[row].index("llm_node: x") + len("llm_node: ") + 1
    assert f"{bad}:{row + 1}:{col}: {where}.resources.llm_node must be a number >= 0" in run.stderr
