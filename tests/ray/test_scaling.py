"""The stage deployments' autoscaling policy, called as Serve's controller calls it: through
Serve's wrapper for custom policies (scaling factors, delays) with Serve's AutoscalingContext,
fed the per-replica figures the replicas report. No cluster needed."""

from __future__ import annotations

import pytest

from omnistage.ray_serve.scaling import METRIC, engine_requests_policy


def decide(held: list[float], current: int, calls: float = 0.0, **config) -> int:
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    deployment = DeploymentID(name="tiny-llm.llm", app_name="omnistage")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=deployment) for i in range(current)]
    cfg = AutoscalingConfig(upscale_delay_s=0, downscale_delay_s=0, **config)
    ctx = AutoscalingContext(
        deployment_id=deployment,
        deployment_name=deployment.name,
        app_name=deployment.app_name,
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=replicas,
        total_num_requests=calls,
        total_queued_requests=0.0,
        aggregated_metrics={METRIC: dict(zip(replicas, held))},
        raw_metrics=None,
        capacity_adjusted_min_replicas=cfg.min_replicas,
        capacity_adjusted_max_replicas=cfg.max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=cfg,
    )
    return _apply_autoscaling_config(engine_requests_policy)(ctx)[0]


@pytest.mark.parametrize(
    ("held", "current", "expected"),
    [
        ([16.0], 1, 1),  # at target
        ([40.0], 1, 3),  # 40 held, 16 each: three replicas
        ([30.0, 34.0], 2, 4),
        ([200.0, 200.0], 2, 25),  # what it asks for; Serve's deployment state caps it at max_replicas
        ([0.0, 0.0, 0.0], 3, 1),  # idle: down to min_replicas
    ],
)
def test_replicas_follow_the_requests_engines_hold(held, current, expected):
    # Serve's own count of ongoing calls (one listen stream per driver) would keep it at 1
    assert decide(held, current, calls=float(current), min_replicas=1, max_replicas=8, target_ongoing_requests=16) == (
        expected
    )
